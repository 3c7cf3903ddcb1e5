"""The test order: the tests within each class (and a module's tests outside classes) are shuffled by a seed, drawn at
random unless TL_VLLM_HOOKS_TEST_SEED=N gives it, so that a test that passes only after another has set up what it
reads shows itself; the seed is printed at the start and the end, and TL_VLLM_HOOKS_TEST_SEED=N repeats the order.
Modules and classes keep their order (the engines they share and the two CI workers' balance follow it), and pytest's
own grouping of tests by a shared parametrized engine runs after the shuffle. The seed is drawn once, where pytest
starts, and reaches pytest-xdist's workers through the environment, so every worker collects the same order.
"""

import os
import random

import pytest

_SEED = "TL_VLLM_HOOKS_TEST_SEED"


def pytest_configure(config):
    os.environ.setdefault(_SEED, str(random.SystemRandom().randrange(1_000_000)))


def _said() -> str:
    return f"test order: shuffled within each class, seed {os.environ[_SEED]} ({_SEED}={os.environ[_SEED]} repeats it)"


def pytest_sessionstart(session):  # (pytest's header is not printed under -q; xdist's workers have no terminal)
    terminal = session.config.pluginmanager.get_plugin("terminalreporter")
    if terminal is not None and not hasattr(session.config, "workerinput"):
        terminal.write_line(_said())


@pytest.hookimpl(tryfirst=True)  # before pytest groups the tests by their parametrized class- and module-scoped engines
def pytest_collection_modifyitems(items):
    shuffle = random.Random(int(os.environ[_SEED])).shuffle
    groups: dict[tuple, list] = {}
    for item in items:
        groups.setdefault((item.module.__name__ if item.module else "", item.cls and item.cls.__name__), []).append(item)
    for group in groups.values():
        shuffle(group)
    items[:] = [item for group in groups.values() for item in group]


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(_said())
