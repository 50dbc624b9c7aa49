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


def _plan_examples() -> list[tuple[str, str]]:
    """(command, printed output) of every `$ shardwise plan` example in the README whose
    hardware is a catalog entry (deterministic: `cpu` is measured on the spot)."""
    examples, cmd, out = [], None, []
    for line in README.read_text().splitlines():
        if cmd is not None and (line.startswith("$ ") or line.startswith("```")):
            examples.append((cmd, "\n".join(out)))
            cmd = None
        if line.startswith("$ shardwise plan") and "--hardware cpu" not in line:
            cmd, out = line[2:], []
        elif cmd is not None:
            out.append(line)
    return examples


def test_readme_plan_outputs_are_what_the_planner_prints(capsys):
    from shardwise.cli.main import main

    examples = _plan_examples()
    assert len(examples) >= 5, examples  # ZeRO figure 1, the 7B, 70B and 175B scenarios
    for cmd, shown in examples:
        main(cmd.split()[1:])
        printed = capsys.readouterr()
        got = (printed.out + printed.err).strip()
        assert got == shown.strip(), f"README output of `{cmd}` is stale; it now prints:\n{got}"
