"""The README's "Serve" example and examples/openai_client.py, run as a user would, against a
server (their 127.0.0.1:8000 pointed at the test server's port)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import REPO, SHIPPED


def _serve_example() -> str:
    text = open(os.path.join(REPO, "README.md")).read()
    section = text.split("## Serve", 1)[1].split("\n## ", 1)[0]
    [code] = re.findall(r"```python\n(.*?)```", section, re.S)
    assert "deepinfer serve" in section and 'base_url="http://127.0.0.1:8000/v1"' in code
    return code


def _run(args: list[str]) -> str:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_readme_serve_example_runs(server, client):
    code = _serve_example().replace("http://127.0.0.1:8000", server.url)
    out = _run(["-c", code])
    chat = client.chat.completions.create(model=SHIPPED, max_tokens=32, temperature=0,
                                          messages=[{"role": "user", "content": "def fibonacci(n):"}])
    assert out.startswith(chat.choices[0].message.content + "\n")  # the greedy reply, then the streamed text
    assert len(out) > len(chat.choices[0].message.content) + 1


def test_openai_client_example_runs(server):
    out = _run([os.path.join("examples", "openai_client.py"), "--base-url", server.base_url])
    for label in (f"model: {SHIPPED}", "chat:", "stream:", "json:", "regex:"):
        assert label in out, out
    assert re.search(r'regex: "[0-9]+\.[0-9]+"', out), out
