"""The command lines the chart renders are accepted by the real `vllmfit` argument parser, for every
value set: a renamed or missing flag fails here instead of crash-looping the pods."""

from __future__ import annotations

import pytest

from .conftest import VALUE_SETS, pod_specs


def _parser():
    from vllmfit import main as cli

    parser = cli.build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    return parser, set(commands)


def _substitute(arg: str, env: dict[str, str]) -> str:
    # Kubernetes expands $(VAR) from the container's env; fieldRefs get a sample value here
    for name, value in env.items():
        arg = arg.replace(f"$({name})", value)
    return arg


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_rendered_command_lines_parse(render, value_set):
    parser, commands = _parser()
    for where, spec in pod_specs(render(value_set)):
        for c in spec["containers"]:
            assert c["command"][0] == "vllmfit", f"{where}: the image's entry point is vllmfit"
            sub = c["command"][1]
            if sub not in commands:
                pytest.skip(f"`vllmfit {sub}` is not registered in this checkout")
            env = {e["name"]: e.get("value", f"sample-{e['name'].lower()}") for e in c.get("env", [])}
            argv = [sub, *(_substitute(a, env) for a in c.get("args", []))]
            try:
                args = parser.parse_args(argv)
            except SystemExit as e:  # argparse prints the reason to stderr
                raise AssertionError(f"{where}: `vllmfit {' '.join(argv)}` is refused by the parser") from e
            assert callable(args.func), where
