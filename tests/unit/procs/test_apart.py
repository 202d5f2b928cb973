"""`procs.apart.in_child`: a function run in a forked child, its outcome and the signals that stop a run passed on."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from monarch_plugin.errors import ConfigError, ElasticRunAborted, RunStopped
from monarch_plugin.procs.apart import in_child


def _started_a_thread() -> int:
    threading.Thread(target=time.sleep, args=(30,), daemon=True, name="left-in-the-child").start()
    os.environ["SET_IN_THE_CHILD"] = "1"
    return os.getpid()


def test_the_value_comes_back_and_what_the_child_started_stays_there():
    assert in_child(_started_a_thread) != os.getpid()
    assert "left-in-the-child" not in {t.name for t in threading.enumerate()}
    assert "SET_IN_THE_CHILD" not in os.environ


def _raise(error: BaseException):
    def run():
        raise error
    return run


@pytest.mark.parametrize("error", [ConfigError("bad `replicas`", "replicas"),
                                   ElasticRunAborted("gave up", "/ckpt/step8"),
                                   RunStopped("told to stop", "/ckpt/step9", "SIGUSR1")])
def test_the_runtimes_errors_come_back_whole(error):
    with pytest.raises(type(error)) as raised:
        in_child(_raise(error))
    assert str(raised.value) == str(error) and vars(raised.value) == vars(error)


def test_another_error_carries_the_childs_traceback():
    with pytest.raises(ZeroDivisionError) as raised:
        in_child(lambda: 1 / 0)
    assert "raised in the run's controller process" in "".join(raised.value.__notes__)


def test_a_child_that_dies_before_it_reports_is_a_stopped_run_naming_how():
    with pytest.raises(ElasticRunAborted, match="ended by signal SIGKILL before it reported"):
        in_child(lambda: os.kill(os.getpid(), signal.SIGKILL))


def _wait_for(signum: int, ready: str):
    """In the child: note `signum` when it comes, say it is ready, and return whether it came within 10 s."""
    def run():
        got = []
        signal.signal(signum, lambda *_: got.append(signum))
        open(ready, "w").close()
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        return got
    return run


def _signal_self_when(ready: str, signum: int, times: int = 1) -> None:
    def send():
        while not os.path.exists(ready):
            time.sleep(0.01)
        for _ in range(times):
            os.kill(os.getpid(), signum)
    threading.Thread(target=send, daemon=True).start()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_with_notice_to_this_process_is_passed_on_and_its_handler_put_back(tmp_path, signum):
    before = signal.getsignal(signum)
    ready = str(tmp_path / "ready")
    _signal_self_when(ready, signum)
    assert in_child(_wait_for(signum, ready)) == [signum]
    assert signal.getsignal(signum) is before


def _interrupted(ready: str):
    def run():
        open(ready, "w").close()
        try:
            time.sleep(10)
        except KeyboardInterrupt:
            time.sleep(0.5)  # the shutdown a second SIGINT must not cut short
            raise
        return "not interrupted"
    return run


def test_ctrl_c_reaches_the_child_once_however_often_it_is_sent_and_is_raised_here(tmp_path):
    ready = str(tmp_path / "ready")
    _signal_self_when(ready, signal.SIGINT, times=3)
    with pytest.raises(KeyboardInterrupt):
        in_child(_interrupted(ready))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
