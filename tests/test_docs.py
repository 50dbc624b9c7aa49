"""The README and docs/ say what the code does: the config reference is the generated one,
every `shardwise` command they show is accepted (the quick ones are run), the planner's
printed examples are what it prints now, and the pages stay short."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from shardwise.cli import data as cli_data
from shardwise.cli import export as cli_export
from shardwise.cli import launch as cli_launch
from shardwise.cli import main as cli_main
from shardwise.cli import plan as cli_plan
from shardwise.cli import profile as cli_profile
from shardwise.config import load_config, reference_markdown, split_overrides
from shardwise.plan.hardware import take_hardware_overrides

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
SHELL = ("```bash", "```sh", "```shell", "```console")


def test_config_reference_is_current():
    """docs/config.md holds exactly the table `--help-config` prints (one source)."""
    text = (ROOT / "docs" / "config.md").read_text()
    start = text.index("<!-- config-reference:start -->") + len("<!-- config-reference:start -->")
    end = text.index("<!-- config-reference:end -->")
    assert text[start:end].strip() == reference_markdown().strip(), (
        "docs/config.md is stale: regenerate it from shardwise.config.reference_markdown()"
    )


def test_readme_has_the_two_setup_commands():
    """The README's install section is the two make targets."""
    text = README.read_text()
    assert "make train" in text and "make test" in text


def test_readme_and_results_stay_short():
    """The README is an entry page (<= 300 lines) and RESULTS.md shows current figures
    (<= 600 lines); details live in docs/ and the dated history."""
    assert len(README.read_text().splitlines()) <= 300
    assert len((ROOT / "benchmarks" / "RESULTS.md").read_text().splitlines()) <= 600


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_pages_link_to_existing_files():
    """Every relative Markdown link of README, docs/, RESULTS.md and the dated history pages
    names a file that exists, and a `#section` in it names one of that file's headings."""
    broken = []
    history = sorted((ROOT / "benchmarks" / "history").glob("*.md"))
    for page in [*PAGES, ROOT / "benchmarks" / "RESULTS.md", *history]:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text()):
            path = (page.parent / target) if target else page
            if "://" in target:
                continue
            if not path.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and path.is_file():
                headings = re.findall(r"^#+ (.*)$", path.read_text(), re.M)
                if anchor not in {_anchor(h) for h in headings}:
                    broken.append(f"{page.name}: {target}#{anchor}")
    assert not broken, broken


# A path a page names in backticks (`parallel/zero.py`, `benchmarks/published/`), found from
# the repository root, the package, src/ or benchmarks/ (pages name it from where it reads
# best); `folder/module.name` and `shardwise.module.name` name something defined there.
NAMED_PATH = re.compile(r"`([\w.-]+(?:/[\w.-]+)*(?:\.(?:py|md|toml|sh|jsonl?|txt)|/))`")
NAMED_ATTR = re.compile(
    r"`((?:[a-z_]+/)+[a-z_0-9]+)\.(?!(?:py|md|toml|sh|jsonl?|txt)`)([A-Za-z_]\w*)(?:\(\))?`"
)
NAMED_DOTTED = re.compile(r"`(shardwise(?:\.\w+)+)")
SRC = ROOT / "src" / "shardwise"


def test_named_files_and_names_exist():
    """Every file or folder a page names in backticks exists, and every `plan/memory.fn` or
    `shardwise.module.name` is defined: a moved or renamed module fails here."""
    keys = set(re.findall(r"^\| `([\w.]+)` \|", reference_markdown(), re.M))
    missing = []
    for page in [*PAGES, ROOT / "benchmarks" / "RESULTS.md"]:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            where = f"{page.name}:{number}"
            for path in NAMED_PATH.findall(line):
                bases = (ROOT, SRC, ROOT / "src", ROOT / "benchmarks")
                in_run = path.split("/")[0] in keys  # `run.dir/metrics.jsonl`: a run's file
                if (
                    "/" in path.rstrip("/")
                    and not in_run
                    and not any((b / path).exists() for b in bases)
                ):
                    missing.append(f"{where}: {path}")
            for module, name in NAMED_ATTR.findall(line):
                file = SRC / f"{module}.py"
                file = file if file.exists() else SRC / module / "__init__.py"
                defined = rf"^\s*(?:async def|def|class)\s+{name}\b|^\s*{name}\s*[:=]"
                if not file.exists() or not re.search(defined, file.read_text(), re.M):
                    missing.append(f"{where}: {module}.{name}")
            missing += [f"{where}: {d}" for d in NAMED_DOTTED.findall(line) if not _defined(d)]
    assert not missing, missing


def test_architecture_map_names_real_modules():
    """Every `name.py` in architecture.md's map of the code (its first plain code block) is a
    module of the package (or, with a folder, a file of the repository)."""
    tree = re.search(
        r"^```\n(.*?)^```", (ROOT / "docs" / "architecture.md").read_text(), re.M | re.S
    )
    modules = {p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")}
    names = re.findall(r"(?<![\w/.])((?:\w+/)*\w+\.py)\b", tree.group(1))
    assert len(names) > 50, names  # the map is still found
    placeholders = {"file.py"}  # `file.py:name`, a user's file
    stale = [
        n
        for n in names
        if n not in placeholders
        and n not in modules
        and not (ROOT / n).exists()
        and ("/" in n or not any(m.endswith("/" + n) or m == n for m in modules))
    ]
    assert not stale, stale


def _defined(dotted: str) -> bool:
    """Whether `shardwise.a.b.name` imports: the longest module prefix, then attributes."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
        return obj is not None
    return False


def test_every_config_key_is_explained():
    """Every config key is shown in a page a user reads (README or docs/ beside config.md's
    generated table), so a new option comes with its narrative."""
    pages = [p for p in PAGES if p.name != "config.md"]
    text = "\n".join(p.read_text() for p in pages)
    keys = re.findall(r"^\| `([\w.]+)` \|", reference_markdown(), re.M)
    assert len(keys) > 50, keys  # the table's format still parses
    unexplained = [k for k in keys if not re.search(rf"(?<![\w.]){re.escape(k)}(?![\w])", text)]
    assert not unexplained, f"keys only in docs/config.md's table: {unexplained}"


def shell_commands() -> list[tuple[str, list[str]]]:
    """(page:line, argv after `shardwise`) of every line in a fenced shell block of README
    and docs/ that starts with `shardwise` (continuations joined, comments dropped)."""
    found = []
    for page in PAGES:
        in_shell, pending, start = False, "", 0
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.startswith("```"):
                in_shell = line.strip() in SHELL
                continue
            if not in_shell:
                continue
            if not pending:
                start = number
            pending += line.removesuffix("\\")
            if line.endswith("\\"):
                continue
            text, pending = pending.strip().removeprefix("$ "), ""
            if text.split(" ", 1)[0] == "shardwise":
                found.append((f"{page.name}:{start}", shlex.split(text, comments=True)[1:]))
    return found


def _absolute(argv: list[str]) -> list[str]:
    return [str(ROOT / a) if a.startswith("examples/") else a for a in argv]


def _needs_files(argv: list[str]) -> bool:
    """Whether the command's config points at a checkpoint or data the reader supplies."""
    config = next((a for a in argv[1:] if a.endswith(".toml")), None)
    cfg = load_config(config, split_overrides(argv[1:])[1])
    data = cfg.data.dataset
    return bool(cfg.model.init_from) or (
        data not in ("stdlib", "digits") and not Path(data).exists()
    )


def _parse(argv: list[str]) -> None:
    """Parse a command as the CLI does, and load its config, without running it."""
    command, rest = argv[0], argv[1:]
    own, overrides = split_overrides(rest)
    if command in ("train", "explain"):
        args, leftover = cli_main.parser(command).parse_known_args(own)
        overrides = take_hardware_overrides(overrides)[1]
    elif command == "profile":
        args, leftover = cli_profile._parser().parse_known_args(own)
    elif command == "plan":
        args, leftover = cli_plan.parser().parse_known_args(own)
    elif command == "launch":
        args, leftover = cli_launch._parser().parse_args(own), []
    elif command == "export":
        args, leftover = cli_export._parser().parse_known_intermixed_args(own)
        assert not leftover and len(args.paths) == 2 and args.format, argv
        return
    elif command == "data":
        args = cli_data._parser().parse_args(own)
        assert args.verb == "prepare" and args.inputs and args.out, argv
        return
    else:
        raise AssertionError(f"unknown command {command}")
    assert not leftover, f"unknown options {leftover}"
    load_config(args.config, overrides)


@pytest.mark.parametrize("where, argv", shell_commands(), ids=lambda v: str(v))
def test_shown_command_is_accepted(where, argv, tmp_path, monkeypatch, capsys):
    """Each `shardwise ...` line shown in a shell block parses and its config loads; help,
    `explain`, `plan` (not --verify) and `launch` (not submitted, into a scratch folder) run
    and exit 0, so a renamed key or option fails here rather than for a reader."""
    argv = _absolute(argv)
    quick = not argv or argv[0].startswith("-")
    quick = quick or (argv[0] == "plan" and "--verify" not in argv)
    quick = quick or (argv[0] in ("explain", "launch") and not _needs_files(argv))
    if not quick:
        _parse(argv)
        return
    monkeypatch.chdir(tmp_path)
    argv = [a for a in argv if a != "--submit"]
    code = cli_main.main(argv)
    assert code == 0, f"{where}: `shardwise {shlex.join(argv)}` exited {code}: " + str(
        capsys.readouterr().err
    )


def test_commands_are_found():
    """The extraction above sees the README's tour and the docs' commands (not zero)."""
    where = [w for w, _ in shell_commands()]
    assert sum(w.startswith("README.md") for w in where) >= 10
    assert len(where) >= 40


def _plan_examples() -> list[tuple[str, str]]:
    """(command, printed output) of every `$ shardwise plan` example in README and docs/
    whose hardware is a catalog entry (deterministic: `cpu` is measured on the spot)."""
    examples = []
    for page in PAGES:
        cmd, out = None, []
        for line in page.read_text().splitlines():
            if cmd is not None and (line.startswith("$ ") or line.startswith("```")):
                examples.append((cmd, "\n".join(out)))
                cmd = None
            if line.startswith("$ shardwise plan") and "--hardware cpu" not in line:
                cmd, out = line[2:], []
            elif cmd is not None:
                out.append(line)
    return examples


def test_plan_outputs_are_what_the_planner_prints(capsys):
    """The planner's outputs shown in docs/planner.md are exactly what it prints today."""
    examples = _plan_examples()
    assert len(examples) >= 5, examples  # ZeRO figure 1, the 7B, 70B and 175B scenarios
    for cmd, shown in examples:
        cli_main.main(cmd.split()[1:])
        printed = capsys.readouterr()
        got = (printed.out + printed.err).strip()
        assert got == shown.strip(), f"docs output of `{cmd}` is stale; it now prints:\n{got}"


# Words about how the project is worked on, not about what it does, and paths of one machine.
PROCESS_WORDS = re.compile(
    r"\bsessions?\b|\bissues? #?\d+|\blent\b|\bthe issue's\b"
    r"|(?<![\w.~-])/(?:work|tmp|root|home)/",
    re.IGNORECASE,
)
# A citation of an upstream project's tracker ("NVIDIA/nccl issue #964", a GitHub URL).
CITATION = re.compile(r"[\w.-]+/[\w.-]+ issues? #\d+|https?://\S+", re.IGNORECASE)
# (file, text of the line) where a matched word means something else.
ALLOWED = {
    ("tests/conftest.py", "def pytest_collection_modifyitems(session, config, items):"),
    ("src/shardwise/data/callables.py", "is defined in an interactive session."),
}


def _tracked_text_files() -> list[Path]:
    import subprocess

    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    # this file spells the words out to find them
    return [ROOT / n for n in names if n and n != "tests/test_docs.py" and (ROOT / n).is_file()]


def test_no_process_words_or_machine_paths():
    """Tracked files speak of the project, not of how it was worked on ("session", "issue
    12", "lent", "the issue's"), and name no absolute path of one machine (/work/, /tmp/,
    /root/, /home/). Citations of upstream trackers and the lines in ALLOWED are exempt."""
    hits = []
    for path in _tracked_text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # binary
        rel = path.relative_to(ROOT).as_posix()
        for number, line in enumerate(text.splitlines(), 1):
            cleaned = CITATION.sub("", line)
            if PROCESS_WORDS.search(cleaned) and not any(
                rel == f and allowed in line for f, allowed in ALLOWED
            ):
                hits.append(f"{rel}:{number}: {line.strip()[:120]}")
    assert not hits, "\n".join(hits)
