"""Run the README's and the guide's Python blocks as printed, each in a fresh directory and interpreter.

    python3 scripts/readme_snippets.py             # each block on its own (CI runs this)
    python3 scripts/readme_snippets.py --together  # also all of them, in order, as one script

The blocks are read from the files themselves (DOCS: README.md, docs/guide.md), so what CI runs is what a reader
copies. Each runs with this project's modules importable and without the environment CI sets for its tests
(VLLM_CPU_KVCACHE_SPACE): a block must pass what a CPU needs itself, as a new user would. A print line whose
comment is a Python literal says what it prints, and the block must print it; a block with none fails, as does a
file holding another number of blocks than DOCS says. Exit code 1 if any block fails, with the end of its output.
"""

import argparse
import ast
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every file whose ```python blocks a reader runs, with how many it holds: a block whose fence changes would drop out
# of the run unseen, so a count that differs fails it.
DOCS = {"README.md": 3, "docs/guide.md": 4}


def python_blocks(readme: str) -> list[tuple[int, str]]:
    """(line number, code) of every ```python block."""
    return [
        (readme[: match.start()].count("\n") + 2, match.group(1))
        for match in re.finditer(r"^```python\n(.*?)^```", readme, re.MULTILINE | re.DOTALL)
    ]


def stated_results(code: str) -> list[object]:
    """What the block's print lines say they print: a comment that is a Python literal, alone or before ": " and
    prose (``print(x)  # [[12, 128], [5, 128]]``); an illustration with ``...`` in it states nothing."""
    stated = []
    for line in code.splitlines():
        match = re.match(r"\s*print\(.*\)\s+#\s*(.+)$", line)
        if match is None:
            continue
        comment = match.group(1)
        for text in (comment, *(comment[: m.start()] for m in re.finditer(": ", comment))):
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                continue
            if "Ellipsis" not in repr(value):
                stated.append(value)
            break
    return stated


def printed_values(stdout: str) -> list[object]:
    values = []
    for line in stdout.splitlines():
        try:
            values.append(ast.literal_eval(line.strip()))
        except (ValueError, SyntaxError):
            pass
    return values


def run(name: str, code: str) -> bool:
    stated = stated_results(code)
    if not stated:
        print(f"{name}: FAILED: none of its print lines says what it prints (a comment that is a Python literal)")
        return False
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="readme_") as directory:
        with open(os.path.join(directory, "snippet.py"), "w") as file:
            file.write(code)
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "snippet.py"], cwd=directory, env=env, capture_output=True, text=True, timeout=900
        )
    took = time.perf_counter() - started
    missing = [value for value in stated if value not in printed_values(done.stdout)]
    if done.returncode == 0 and missing:
        tail = done.stdout.splitlines()[-10:]
        print("\n".join([f"{name}: FAILED: it did not print {missing}, as its comments say; it printed last:", *tail]))
        return False
    if done.returncode == 0:
        printed = done.stdout.strip().splitlines()[-1:] or ["(nothing)"]
        print(f"{name}: ok in {took:.0f} s; it printed last: {printed[0][:300]}", flush=True)
        return True
    tail = (done.stdout + done.stderr).splitlines()[-40:]
    print("\n".join([f"{name}: FAILED (exit code {done.returncode}) in {took:.0f} s; the end of its output:", *tail]))
    return False


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--together", action="store_true", help="also run every block in order as one script")
    args = parser.parse_args()
    blocks, results = [], []  # (where, code), in DOCS' order
    for doc, expected in DOCS.items():
        with open(os.path.join(ROOT, doc)) as file:
            found = python_blocks(file.read())
        print(f"{len(found)} Python blocks in {doc}", flush=True)
        if len(found) != expected:
            print(f"{doc}: FAILED: {len(found)} Python blocks, where DOCS says {expected}: a fence changed, or DOCS")
            results.append(False)
        blocks += [(f"{doc} line {line}", code) for line, code in found]
    results += [run(where, code) for where, code in blocks]
    if args.together:
        results.append(run("every block in order", "\n".join(code for _where, code in blocks)))
    sys.exit(0 if blocks and all(results) else 1)
