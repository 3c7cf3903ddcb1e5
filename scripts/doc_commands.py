"""Run docs/guide.md's shell sessions and the README's and guide's inline commands, as printed.

    python3 scripts/doc_commands.py   # CI runs this after scripts/readme_snippets.py

Shell sessions: every ``` block without a language whose lines start with "$ " is read from docs/guide.md itself
(SESSIONS: how many it holds; another number fails, so a changed fence cannot drop a session unseen). Each session
runs in a fresh temporary directory, in order, each "$ " line through bash, with this project importable
(PYTHONPATH) and without the environment CI sets for its tests (VLLM_CPU_KVCACHE_SPACE), `python3` being this
interpreter. Each line must exit 0, and the lines the guide shows after it must each appear, in order, among the
lines it printed (stdout and stderr together, as a terminal shows them): lines the guide leaves out (a warning) may
come between them. Both sides are compared normalized: every token holding a "/" (a path, a URL, "2/2", "tok/s")
is one placeholder, every number (a run of digits with the "." or "," inside it; not digits inside a word, as in
blocks.0.attn.hook_z or a hex fingerprint) another, and whitespace is collapsed: times, speeds, errors and paths may
differ from the guide's, and nothing else may.

A session line followed by its output and a "^C..." line (the guide's `serve` session) runs in the background: once
the lines shown before the "^C" have all appeared, it is sent one completion request over HTTP (the model's path,
a prompt of three token ids, max_tokens 2), which must answer with a choice; then at once SIGINT goes to its process
group, as a terminal's Ctrl-C sends it, and it must print the text after "^C" and exit 130 (128 + SIGINT), its
request's rows whole in the sink directory the command names (--sink-dir), read as a client reads them
(tl_vllm_hooks_tools.CaptureDataset: one request, a row per prompt token and generated token but the last, for each hook):
the stop writes the rows the sink holds.

Inline commands (INLINE): each must appear verbatim in README.md or docs/guide.md, where a reader copies it from, so
that a changed doc fails here instead of dropping out. `python3 tl_vllm_hooks_tools.py demo` runs in a fresh directory
holding copies of tl_vllm_hooks.py and tl_vllm_hooks_tools.py alone, without PYTHONPATH, as a user who copied the
two files in (its exit code is its verdict); `python3 -m tl_vllm_hooks_tools families` must exit 0 and print something;
the README's `serve` command must be the guide's serve session's command, which runs above (not twice).

Exit code 1 if anything fails, with the end of the output concerned.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDE = "docs/guide.md"
DOCS = ("README.md", GUIDE)  # where the inline commands are read by a user
SESSIONS = 2  # shell sessions in GUIDE: a fence that changes would drop one unseen, so another count fails
# The inline commands run, each as the docs print it (DOCS must hold each verbatim).
DEMO_COPIED = "python3 tl_vllm_hooks_tools.py demo"
FAMILIES = "python3 -m tl_vllm_hooks_tools families"
SERVE = "python3 -m tl_vllm_hooks_tools serve tiny --sites resid_post --sink-dir acts --port 8000"  # = the serve session's
INLINE = (DEMO_COPIED, FAMILIES, SERVE)
COMMAND_SECONDS = 900  # each command's limit (a compiled engine's start on a busy 2-core machine included)
SERVING_SECONDS = 600  # for a served session to print what the guide shows before its ^C
STOP_SECONDS = 60  # for it to stop after SIGINT
TAIL = 40  # lines of output shown with a failure


def sessions(text: str) -> list[tuple[int, list[str]]]:
    """(line number of the first line, lines) of every ``` block without a language that has a "$ " line."""
    found, block, start = [], None, 0
    for number, line in enumerate(text.splitlines(), 1):
        if block is None and line.startswith("```"):
            block, start, language = [], number + 1, line[3:].strip()
        elif block is not None and line.strip() == "```":
            if not language and any(row.startswith("$ ") for row in block):
                found.append((start, block))
            block = None
        elif block is not None:
            block.append(line)
    return found


def normalized(line: str) -> str:
    """A line as compared: a token holding "/" one placeholder, a number another (not the digits inside a word:
    blocks.0.attn.hook_z, a hex digest), whitespace collapsed."""
    tokens = ("<path>" if "/" in token else token for token in line.split())
    return re.sub(r"(?<![\w.])\d+(?:[.,]\d+)*", "<n>", " ".join(tokens))


def unmatched(shown: list[str], printed: list[str]) -> str | None:
    """The first of the guide's lines (shown) not found, in order, among the printed ones; None where all are."""
    printed = [normalized(line) for line in printed]
    at = 0
    for line in shown:
        want = normalized(line)
        if not want:
            continue
        while at < len(printed) and printed[at] != want:
            at += 1
        if at == len(printed):
            return line
        at += 1
    return None


def environment(project: bool = True) -> dict[str, str]:
    """A user's environment: this interpreter's `python3` first on PATH, no VLLM_CPU_KVCACHE_SPACE; with project,
    this repository importable (PYTHONPATH), else no PYTHONPATH at all."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    if project:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    else:
        env.pop("PYTHONPATH", None)
    return env


def failed(what: str, why: str, output: list[str]) -> bool:
    print("\n".join([f"{what}: FAILED: {why}; the end of its output:", *output[-TAIL:]]), flush=True)
    return False


def run_line(where: str, command: str, shown: list[str], directory: str, env: dict[str, str]) -> bool:
    """One "$ " line in the foreground: exit code 0, and the lines shown after it printed."""
    started = time.perf_counter()
    try:
        done = subprocess.run(
            ["bash", "-c", command], cwd=directory, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, timeout=COMMAND_SECONDS,
        )
    except subprocess.TimeoutExpired as error:
        output = (error.stdout or b"").decode(errors="replace") if isinstance(error.stdout, bytes) else error.stdout
        return failed(f"{where}: $ {command}", f"still running after {COMMAND_SECONDS} s", (output or "").splitlines())
    took = time.perf_counter() - started
    printed = done.stdout.splitlines()
    if done.returncode != 0:
        return failed(f"{where}: $ {command}", f"exit code {done.returncode} in {took:.0f} s", printed)
    missing = unmatched(shown, printed)
    if missing is not None:
        return failed(f"{where}: $ {command}", f"it did not print the guide's line {missing!r}", printed)
    print(f"{where}: $ {command}: ok in {took:.0f} s ({len(shown)} lines as shown)", flush=True)
    return True


def sink_dir(command: str) -> str:
    match = re.search(r"--sink-dir[ =](\S+)", command)
    if match is None:
        raise ValueError(f"{command}: a served session names no --sink-dir")
    return match.group(1)


def request(command: str) -> tuple[dict, list[int]]:
    """One completion request to the served command's server: (its answer, the prompt's token ids)."""
    port = re.search(r"--port[ =](\d+)", command)
    model = command.split(" serve ")[1].split()[0]
    prompt = [5, 9, 33]
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}).encode()
    post = urllib.request.Request(
        f"http://127.0.0.1:{port.group(1) if port else 8000}/v1/completions", data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(post, timeout=120) as answer:
        return json.load(answer), prompt


def check_sink(directory: str, request_id: str, prompt: list[int], answer: dict, wait: float) -> str | None:
    """What is wrong with the sink's rows of the one request served; None where they are whole."""
    sys.path.insert(0, ROOT)
    import tl_vllm_hooks_tools as tools  # (this project's)

    try:
        dataset = tools.CaptureDataset.wait(directory, [request_id], timeout=wait)
    except (TimeoutError, ValueError) as error:
        return str(error)
    rows = len(prompt) + answer["usage"]["completion_tokens"] - 1  # the last generated token never runs
    shapes = {hook: list(tensor.shape) for hook, tensor in dataset[request_id].items()}
    if len(dataset) != 1 or not shapes or any(shape[0] != rows for shape in shapes.values()):
        return f"{len(dataset)} requests ({list(dataset)}), {request_id!r}'s rows {shapes}; expected 1 of {rows} rows"
    return None


def run_served(where: str, command: str, shown: list[str], stopped: str, directory: str, env: dict[str, str]) -> bool:
    """A "$ " line ended by ^C: in the background until it printed the lines shown, one request, then SIGINT."""
    what = f"{where}: $ {command}"
    port = int(re.search(r"--port[ =](\d+)", command).group(1)) if "--port" in command else 8000
    with socket.socket() as probe:  # (another server there would answer in its place)
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            return failed(what, f"port {port} is taken on this machine: free it first", [])
    started = time.perf_counter()
    process = subprocess.Popen(
        ["bash", "-c", command], cwd=directory, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,  # (its own group, as a terminal's job)
    )
    printed: list[str] = []
    reader = threading.Thread(target=lambda: printed.extend(line.rstrip("\n") for line in process.stdout))
    reader.start()
    try:
        while unmatched(shown, printed) is not None:
            if process.poll() is not None or time.perf_counter() - started > SERVING_SECONDS:
                reader.join(5)
                why = f"exit code {process.returncode}" if process.poll() is not None else f"{SERVING_SECONDS} s"
                return failed(what, f"{why} before it printed {unmatched(shown, printed)!r}", printed)
            time.sleep(0.2)
        serving = time.perf_counter() - started
        try:
            answer, prompt = request(command)
        except OSError as error:
            return failed(what, f"the completion request failed: {error}", printed)
        if not answer.get("choices"):
            return failed(what, f"the completion answered no choice: {answer}", printed)
        request_id = f"{answer['id']}-0"  # (the server's id of a completion's first prompt)
        sink = os.path.join(directory, sink_dir(command))
        before = len(printed)
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C at once: the stop writes the rows the sink holds
        try:
            process.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            return failed(what, f"still running {STOP_SECONDS} s after SIGINT", printed)
        reader.join(10)
        if process.returncode != 128 + signal.SIGINT:
            return failed(what, f"exit code {process.returncode} after SIGINT, not {128 + signal.SIGINT}", printed)
        if unmatched([stopped], printed[before:]) is not None:
            return failed(what, f"it did not print the guide's {stopped!r} after SIGINT", printed)
        problem = check_sink(sink, request_id, prompt, answer, wait=0)
        if problem is not None:
            return failed(what, f"after the stop, {sink}: {problem}", printed)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        reader.join(10)
    took = time.perf_counter() - started
    print(
        f"{what}: ok in {took:.0f} s (serving after {serving:.0f} s; one request, ^C as soon as it was answered, "
        "exit code 130, its rows on disk)",
        flush=True,
    )
    return True


def run_session(start: int, lines: list[str]) -> bool:
    """A session's "$ " lines in order, in a fresh directory; each one's output is the lines up to the next."""
    env = environment()
    steps: list[tuple[int, str, list[str]]] = []  # (line number, command, lines shown after it)
    for number, line in enumerate(lines, start):
        if line.startswith("$ "):
            steps.append((number, line[2:], []))
        elif not steps:
            print(f"{GUIDE} line {number}: FAILED: a session's first line is not a command: {line!r}")
            return False
        else:
            steps[-1][2].append(line)
    with tempfile.TemporaryDirectory(prefix="doc_session_") as directory:
        for number, command, shown in steps:
            where = f"{GUIDE} line {number}"
            stops = [i for i, line in enumerate(shown) if line.startswith("^C")]
            if stops and stops != [len(shown) - 1]:
                print(f"{where}: FAILED: a ^C line must end the command's output")
                return False
            if stops:
                ok = run_served(where, command, shown[:-1], shown[-1][2:], directory, env)
            else:
                ok = run_line(where, command, shown, directory, env)
            if not ok:
                return False  # (the lines after it need what it made)
    return True


def run_copied_demo() -> bool:
    """DEMO_COPIED in a directory holding the two files alone, without PYTHONPATH: exit code 0."""
    with tempfile.TemporaryDirectory(prefix="doc_copied_") as directory:
        for name in ("tl_vllm_hooks.py", "tl_vllm_hooks_tools.py"):
            shutil.copy(os.path.join(ROOT, name), directory)
        return run_line("README.md line 21 (copied in)", DEMO_COPIED, [], directory, environment(project=False))


def run_families() -> bool:
    with tempfile.TemporaryDirectory(prefix="doc_families_") as directory:
        done = subprocess.run(
            ["bash", "-c", FAMILIES], cwd=directory, env=environment(), stdin=subprocess.DEVNULL,
            capture_output=True, text=True, timeout=COMMAND_SECONDS,
        )
    if done.returncode != 0 or not done.stdout.strip():
        why = f"exit code {done.returncode}" if done.returncode else "it printed nothing"
        return failed(FAMILIES, why, (done.stdout + done.stderr).splitlines())
    print(f"{FAMILIES}: ok ({len(done.stdout.splitlines())} lines)", flush=True)
    return True


def main() -> int:
    started = time.perf_counter()
    texts = {}
    for doc in DOCS:
        with open(os.path.join(ROOT, doc)) as file:
            texts[doc] = file.read()
    results = []
    for command in INLINE:
        if not any(f"`{command}`" in text for text in texts.values()):
            print(f"FAILED: the inline command `{command}` is in none of {', '.join(DOCS)}: a doc changed, or INLINE")
            results.append(False)
    found = sessions(texts[GUIDE])
    print(f"{len(found)} shell sessions in {GUIDE}", flush=True)
    if len(found) != SESSIONS:
        print(f"{GUIDE}: FAILED: {len(found)} shell sessions, where SESSIONS says {SESSIONS}: a fence changed, or it")
        results.append(False)
    served = [line[2:] for _start, lines in found for line in lines if line.startswith("$ ") and " serve " in line]
    if served != [SERVE]:
        print(f"{GUIDE}: FAILED: its serve sessions run {served}, where the README's inline command is `{SERVE}`")
        results.append(False)
    results += [run_session(start, lines) for start, lines in found]
    results.append(run_copied_demo())
    results.append(run_families())
    print(f"{'ok' if all(results) else 'FAILED'} in {time.perf_counter() - started:.0f} s", flush=True)
    return 0 if results and all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
