"""The README's set-up commands are exactly what CI (.ci/run) runs, so a newcomer who copies
them gets what CI checked."""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _readme_setup_commands() -> list[str]:
    text = open(os.path.join(REPO, "README.md")).read()
    section = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)
            for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readme_commands_in_a_fresh_venv():
    commands = _readme_setup_commands()
    assert len(commands) == 2, commands  # install + run the shipped model; run the tests
    ci = [line.strip() for line in open(os.path.join(REPO, ".ci", "run")).read().splitlines()]
    for command in commands:
        assert command in ci, f"README command not in .ci/run: {command}"
    assert any(line.startswith("python3 -m venv") for line in ci), ".ci/run must build a fresh venv"
    assert not any("system-site-packages" in line for line in ci)
