"""The README's config reference is the one generated from the dataclass help strings."""

from pathlib import Path

from shardwise.config import reference_markdown

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_config_reference_is_current():
    text = README.read_text()
    start = text.index("<!-- config-reference:start -->") + len("<!-- config-reference:start -->")
    end = text.index("<!-- config-reference:end -->")
    assert text[start:end].strip() == reference_markdown().strip(), (
        "README config reference is stale: regenerate it from shardwise.config.reference_markdown()"
    )


def test_readme_has_the_two_setup_commands():
    text = README.read_text()
    assert "make train" in text and "make test" in text
