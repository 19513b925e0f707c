"""`kvrelay <cmd> --help` explains every flag (issue 30): every option of every parser the
kvrelay commands build has a help text, and that help shows the default wherever there is
one; serve's flags come from one table (kvrelay/cli_flags.py) that docs/serving.md's flag
table is rendered from, so the two cannot drift; the table keeps vLLM's names and the
engine's defaults."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvrelay import cli, cli_flags
from kvrelay.bench import main as bench_main
from kvrelay.config import EngineArgs
from kvrelay.deploy import main as deploy_main
from kvrelay.deploy import validate
from kvrelay.plan import main as plan_main
from kvrelay.proxy import main as proxy_main


def _with_subparsers(name: str, parser: argparse.ArgumentParser
                     ) -> list[tuple[str, argparse.ArgumentParser]]:
    out = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                out += _with_subparsers(f"{name} {sub_name}", sub)
    return out


PARSERS = [pair for name, build in [
    ("kvrelay", cli.build_parser), ("kvrelay proxy", proxy_main.build_parser),
    ("kvrelay bench", bench_main.build_parser), ("kvrelay deploy", deploy_main.build_parser),
    ("kvrelay validate", validate.build_parser), ("kvrelay plan", plan_main.build_parser),
] for pair in _with_subparsers(name, build())]


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def _help_of(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The action's help as `--help` prints it (defaults filled in), on one line."""
    return " ".join(parser._get_formatter()._expand_help(action).split())


def test_every_command_is_enumerated():
    names = {name for name, _ in PARSERS}
    assert {"kvrelay serve", "kvrelay generate", "kvrelay proxy", "kvrelay bench serve",
            "kvrelay bench compare", "kvrelay deploy", "kvrelay validate",
            "kvrelay plan"} <= names
    assert sum(len(_options(p)) for _, p in PARSERS) > 150


@pytest.mark.parametrize("name, parser", PARSERS, ids=[name for name, _ in PARSERS])
def test_every_flag_has_help_showing_its_default(name, parser):
    missing, no_default = [], []
    for action in _options(parser):
        flag = "/".join(action.option_strings) or action.dest
        if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
            missing.append(flag)
            continue
        shown = cli_flags.default_text(action.default)
        # argparse's BooleanOptionalAction adds "(default: True)" itself
        accepted = {shown, "True"} if action.default is True else {shown}
        if shown is not None and not any(s in _help_of(parser, action) for s in accepted):
            no_default.append(f"{flag} (default {shown!r}): {_help_of(parser, action)}")
    assert missing == [], f"{name}: flags without help"
    assert no_default == [], f"{name}: help without the default"


def test_a_default_is_shown_once_and_nothing_for_unset_flags():
    parser = argparse.ArgumentParser(formatter_class=cli_flags.HelpFormatter)
    parser.add_argument("--n", type=int, default=4, help="count")
    parser.add_argument("--rate", type=float, default=float("inf"), help="per second")
    parser.add_argument("--hosts", nargs="+", default=["a", "b"], help="where")
    parser.add_argument("--said", default=3, help="three (default: 3, said here)")
    parser.add_argument("--pct", default="5%", help="a share")
    parser.add_argument("--unset", default=None, help="nothing to show")
    parser.add_argument("--off", action="store_true", help="a switch")
    helps = {a.dest: _help_of(parser, a) for a in _options(parser)}
    assert helps == {"n": "count (default: 4)", "rate": "per second (default: inf)",
                     "hosts": "where (default: a b)", "said": "three (default: 3, said here)",
                     "pct": "a share (default: 5%)", "unset": "nothing to show",
                     "off": "a switch"}


# ---------------------------------------------------------------------------- serve's table

def _serve_parser() -> argparse.ArgumentParser:
    return dict(PARSERS)["kvrelay serve"]


def test_docs_flag_table_is_the_one_help_is_built_from():
    text = cli_flags.DOCS.read_text()
    assert cli_flags.docs_block(text) == cli_flags.render_markdown(cli_flags.SERVE_FLAGS), (
        "docs/serving.md's flag table is stale: python -m kvrelay.cli_flags --write")
    assert cli_flags.main(["--docs", str(cli_flags.DOCS)]) == 0
    rows = [line for line in cli_flags.docs_block(text).splitlines() if line.startswith("| `")]
    assert len(rows) == sum(len(g.flags) for g in cli_flags.SERVE_FLAGS)
    # every serve option is in the docs, and nothing else is
    documented = {opt for flag in (f for g in cli_flags.SERVE_FLAGS for f in g.flags)
                  for opt in flag.names if opt.startswith("-")}
    parsed = {opt for a in _options(_serve_parser()) for opt in a.option_strings}
    assert documented | {f"--no-{o[2:]}" for o in documented} >= parsed
    assert documented <= parsed


def test_a_stale_docs_block_is_reported_and_rewritten(tmp_path, capsys):
    docs = tmp_path / "serving.md"
    docs.write_text(f"# x\n\n{cli_flags.BEGIN}\n| old |\n{cli_flags.END}\n\nafter\n")
    assert cli_flags.main(["--docs", str(docs)]) == 1
    assert "python -m kvrelay.cli_flags --write" in capsys.readouterr().err
    assert cli_flags.main(["--docs", str(docs), "--write"]) == 0
    text = docs.read_text()
    assert text.startswith("# x\n\n") and text.endswith(f"{cli_flags.END}\n\nafter\n")
    assert cli_flags.docs_block(text) == cli_flags.render_markdown(cli_flags.SERVE_FLAGS)
    assert cli_flags.main(["--docs", str(docs)]) == 0
    with pytest.raises(ValueError, match="markers"):
        cli_flags.docs_block("no markers")


def test_serve_flags_keep_the_engine_defaults_and_names():
    args = cli.build_parser().parse_args(["serve"])
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    assert set(cli.SERVE_ENGINE_FLAGS) <= set(cli_flags.serve_flag_dests())
    for name in cli.SERVE_ENGINE_FLAGS:
        f = fields[name]
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        assert getattr(args, name) == default, name
    options = {o for a in _options(_serve_parser()) for o in a.option_strings}
    for vllm_name in ("--tensor-parallel-size", "-tp", "--data-parallel-size", "-dp",
                      "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
                      "--kv-transfer-config", "--additional-config", "--no-enable-prefix-caching",
                      "--responses-owner-header", "--api-key", "--served-model-name"):
        assert vllm_name in options


def test_serve_help_points_to_the_docs_and_plan_help_names_what_is_required():
    serve = _serve_parser().format_help()
    assert "docs/serving.md" in serve
    assert "(default: 8000)" in serve and "(default: 127.0.0.1)" in serve
    plan = plan_main.build_parser().format_help()
    assert "required inputs:" in plan
    for flag in ("--ttft-ms", "--itl-ms", "--prefill-tok-s", "--prefill-result", "--decode-tok-s",
                 "--decode-batch", "--decode-result", "--rate", "--workload"):
        assert flag in plan.split("required inputs:")[1]
