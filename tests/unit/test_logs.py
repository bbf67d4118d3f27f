"""Terminal vs log files (orlhf/storage/logs.py): what a person sees, and that nothing is lost."""

import io
import logging
import os
import subprocess
import sys
import warnings

import pytest

from orlhf.storage.logs import EVERY_TIME, LOG_DIR_ENV, setup_driver, tail


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    saved = (list(root.handlers), root.level, list(logging.getLogger("orlhf").handlers), os.environ.get(LOG_DIR_ENV))
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in saved[0]:
        root.addHandler(h)
    root.setLevel(saved[1])
    ours = logging.getLogger("orlhf")
    for h in list(ours.handlers):
        ours.removeHandler(h)
    for h in saved[2]:
        ours.addHandler(h)
    logging.captureWarnings(False)
    os.environ.pop(LOG_DIR_ENV, None)
    if saved[3] is not None:
        os.environ[LOG_DIR_ENV] = saved[3]


def test_library_chatter_goes_to_the_file_orlhf_lines_to_the_terminal(tmp_path, restore_logging):
    term = io.StringIO()
    with warnings.catch_warnings():  # an earlier run in this process (as pytest's per-test capture does)
        setup_driver(str(tmp_path / "earlier"), stream=io.StringIO())
    ray_logger = logging.getLogger("ray")
    own = logging.StreamHandler(sys.stderr)  # as `import ray` installs one, ahead of the run's set-up
    ray_logger.addHandler(own)
    ray_logger.propagate = False
    run = setup_driver(str(tmp_path), stream=term)
    run.route_transformers()  # as the driver does where it first imports transformers (launch/run.py)
    assert own not in ray_logger.handlers and ray_logger.propagate
    logging.getLogger("orlhf.launch.run").info("3 model group(s) ready")
    logging.getLogger("vllm.engine").warning("RotaryEmbedding: Failed to load weights")
    logging.getLogger("ray").info("Started a local Ray instance.")
    logging.getLogger("ray._private.authentication").warning("Token authentication is enabled")
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()  # libraries imported by earlier tests (vLLM) may have lowered it
    hf_logging.set_verbosity_warning()
    try:
        hf_logging.get_logger("transformers.tokenization_utils").warning("Special tokens have been added")
    finally:
        hf_logging.set_verbosity(verbosity)
    with warnings.catch_warnings():  # shown even if an earlier import filtered FutureWarnings out
        warnings.simplefilter("always")
        warnings.warn("torch.cuda.amp is deprecated", FutureWarning, stacklevel=2)
    for _ in range(5):
        logging.getLogger("orlhf.trainer.controller").warning("reward is constant")
    for _ in range(2):  # each restart's wait for a node is news: shown every time
        logging.getLogger("orlhf").warning("waiting up to 9 s for a node", extra=EVERY_TIME)
    run.close()
    shown = term.getvalue().splitlines()
    assert shown[0] == "[orlhf] 3 model group(s) ready"
    assert shown.count("[orlhf] reward is constant") == 1
    assert any("repeated 4 more time(s): reward is constant" in line for line in shown)
    assert shown.count("[orlhf] waiting up to 9 s for a node") == 2
    assert not any("RotaryEmbedding" in s or "Ray instance" in s or "deprecated" in s for s in shown)
    logged = (tmp_path / "logs" / "driver.log").read_text()
    assert not any("Special tokens" in s or "Token authentication" in s for s in shown)
    for text in (
        "RotaryEmbedding",
        "Started a local Ray instance",
        "torch.cuda.amp is deprecated",
        "Special tokens",
        "3 model group(s) ready",
    ):
        assert text in logged
    assert os.environ[LOG_DIR_ENV] == str((tmp_path / "logs").resolve())
    assert str(tmp_path / "logs") in run.summary()


def test_verbose_keeps_everything_on_the_terminal(tmp_path, restore_logging):
    term = io.StringIO()
    run = setup_driver(str(tmp_path), verbose=True, stream=term)
    logging.getLogger("vllm.engine").warning("RotaryEmbedding: Failed to load weights")
    assert "RotaryEmbedding" in term.getvalue()
    assert LOG_DIR_ENV not in os.environ and not (tmp_path / "logs").exists()
    assert "--verbose" in run.summary()


def test_a_worker_process_output_lands_in_its_file(tmp_path):
    """C-level and Python output alike (fd 1 and 2 are redirected), as in a rank actor."""
    code = (
        "import os, sys; from orlhf.storage.logs import redirect_output; redirect_output('actor-0'); "
        "print('from python'); sys.stdout.flush(); os.write(2, b'from C stderr\\n')"
    )
    env = {**os.environ, LOG_DIR_ENV: str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout == "" and res.stderr == ""
    text = (tmp_path / "actor-0.log").read_text()
    assert "from python" in text and "from C stderr" in text
    assert tail(tmp_path / "actor-0.log", 1) == "from C stderr"


def test_setup_driver_leaves_transformers_unimported(tmp_path):
    """The driver's main thread starts Ray right after setup_driver; importing transformers there (to route its
    logger) would cost CPU time before Ray's start. route_transformers does it where the driver imports it."""
    code = (
        "import sys; from orlhf.storage.logs import setup_driver; run = setup_driver(sys.argv[1]); "
        "print('transformers' in sys.modules, 'torch' in sys.modules); run.route_transformers(); "
        "import transformers.utils.logging as h; print(h.get_logger().propagate, "
        "h.get_logger().handlers == [])"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "True", "True"]


def test_the_trace_never_reaches_the_terminal_even_before_the_run_logs_exist(restore_logging):
    """The start-up clock marks its first phase (the imports) before setup_driver; the driver's early terminal
    handler (launch/run.py's basicConfig, on the root logger) must not show it."""
    from orlhf.launch.startup_clock import StartupClock

    term = io.StringIO()
    early = logging.StreamHandler(term)
    logging.getLogger().addHandler(early)
    logging.getLogger().setLevel(logging.INFO)
    try:
        StartupClock().mark("imports")
        logging.getLogger("orlhf").info("an orlhf line")
    finally:
        logging.getLogger().removeHandler(early)
    assert term.getvalue() == "an orlhf line\n"
