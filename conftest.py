"""The test order: TL_VLLM_HOOKS_TEST_SEED=N shuffles the tests within each class (and a module's tests outside
classes) by seed N, so that a test that passes only after another has set up what it reads shows itself. Modules and
classes keep their order (the engines they share and the two CI workers' balance follow it), and pytest's own grouping
of tests by a shared parametrized engine runs after the shuffle; the seed is printed at the start and the end.
Without it the order is the files' (what CI runs): seed 101622 found two tests that depend on the order (the LFM2
SAE check's engine arguments, and the row-file counts after reset_batched), not yet mended.
"""

import os
import random

import pytest

_SEED = "TL_VLLM_HOOKS_TEST_SEED"


def _said() -> str:
    return f"test order: shuffled within each class, seed {os.environ[_SEED]} ({_SEED}={os.environ[_SEED]} repeats it)"


def pytest_report_header(config):
    return _said() if _SEED in os.environ else None


@pytest.hookimpl(tryfirst=True)  # before pytest groups the tests by their parametrized class- and module-scoped engines
def pytest_collection_modifyitems(items):
    if _SEED not in os.environ:
        return
    shuffle = random.Random(int(os.environ[_SEED])).shuffle
    groups: dict[tuple, list] = {}
    for item in items:
        groups.setdefault((item.module.__name__ if item.module else "", item.cls and item.cls.__name__), []).append(item)
    for group in groups.values():
        shuffle(group)
    items[:] = [item for group in groups.values() for item in group]


def pytest_terminal_summary(terminalreporter):
    if _SEED in os.environ:
        terminalreporter.write_line(_said())
