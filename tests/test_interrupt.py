"""A Ctrl-C during a sweep stops the sweep: the error a cut run surfaces (Prefect's crash report
failing on an API that is going down) is recognised as the interrupt, not one more failed run."""

import os
import signal

import pytest

from flows import interrupt


def _chained(inner: BaseException) -> Exception:
    try:
        try:
            raise inner
        except BaseException:
            raise ConnectionError("[Errno 111] Connection refused")  # the crash report, its context the interrupt
    except ConnectionError as err:
        return err


def test_an_error_raised_while_handling_an_interrupt_is_an_interrupt():
    interrupt._SEEN.clear()
    assert interrupt.interrupted(_chained(KeyboardInterrupt()))
    assert interrupt.interrupted(_chained(SystemExit(130)))
    assert not interrupt.interrupted(_chained(ValueError("a client's data")))  # a run that failed on its own
    assert not interrupt.interrupted(RuntimeError("plain"))


def test_a_command_whose_error_comes_of_a_ctrl_c_exits_as_interrupted(monkeypatch, capsys, tmp_path):
    """A Ctrl-C that lands in Prefect's task engine before its task run exists comes out as Prefect's
    ``ValueError: Task run is not set`` (seen once through the resident): the command still says
    it was interrupted and exits 130; the same error without an interrupt behind it is an error."""
    from flows import cli

    assert interrupt.from_keyboard_interrupt(_chained(KeyboardInterrupt()))
    assert not interrupt.from_keyboard_interrupt(_chained(SystemExit(130)))
    assert not interrupt.from_keyboard_interrupt(ValueError("Task run is not set"))
    monkeypatch.chdir(tmp_path)
    for err, code, said in ((_chained(KeyboardInterrupt()), 130, "interrupted; continue with flockfl resume"),
                            (ValueError("Task run is not set"), 1, "error: ValueError: Task run is not set")):
        def failing(args, err=err):
            raise err

        monkeypatch.setattr(cli, "cmd_run", failing)
        assert cli.main(["run", "demo", "--no-progress"]) == code
        assert said in capsys.readouterr().err


@pytest.fixture
def sigint_default():
    """Python's own SIGINT handler for the test: a pytest-xdist worker starts with SIGINT
    ignored (Ctrl-C is its controller's), which the watch rightly leaves alone."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_a_sigint_during_the_watch_is_noted_and_still_interrupts(sigint_default):
    with interrupt.watch():
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            signal.sigtimedwait([], 0.01) if hasattr(signal, "sigtimedwait") else None
            for _ in range(10**7):  # the handler runs between bytecodes
                pass
        assert interrupt.interrupted(RuntimeError("whatever the run raised next"))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back
    with interrupt.watch():  # a new sweep starts with a clean note
        assert not interrupt.interrupted(RuntimeError("plain"))


def _frame_in(filename: str, name: str):
    """A frame whose code claims to be ``filename``'s function ``name`` (where a signal may land)."""
    import sys

    src = f"def {name}():\n    return sys._getframe()\n"
    scope = {"sys": sys}
    exec(compile(src, filename, "exec"), scope)
    return scope[name]()


def test_a_ctrl_c_inside_lock_code_comes_again_after_it_and_a_wait_is_interrupted_at_once(sigint_default, monkeypatch):
    """Python's KeyboardInterrupt inside a Condition's __enter__, just after its acquire, leaks the
    lock (a Ctrl-C'd run hung in Prefect's event queue): there the signal is sent again a moment
    later; in a wait, or in flockfl's own code, the interrupt is raised at once. A signal that comes
    back while the handler itself runs is put off again. (The moment is 0.2 s here, not 5 ms: on a
    busy machine this process may not run for 5 ms, and the signal would land between two of the
    test's lines.)"""
    import queue
    import threading
    import time

    monkeypatch.setattr(interrupt, "RETRY_S", 0.2)
    with pytest.raises(KeyboardInterrupt):
        interrupt.lock_safe_sigint(signal.SIGINT, _frame_in(threading.__file__, "wait"))
    with pytest.raises(KeyboardInterrupt):
        interrupt.lock_safe_sigint(signal.SIGINT, _frame_in(__file__, "__enter__"))
    signal.signal(signal.SIGINT, interrupt.lock_safe_sigint)
    for where in ((threading.__file__, "__enter__"), (queue.__file__, "put"), (interrupt.__file__, "lock_safe_sigint")):
        returned = []
        with pytest.raises(KeyboardInterrupt):
            t0 = time.monotonic()
            interrupt.lock_safe_sigint(signal.SIGINT, _frame_in(*where))
            returned.append(time.monotonic() - t0)  # no interrupt here, in the lock's code
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # but a moment later, outside it
                time.sleep(0.001)
        assert returned and returned[0] < 0.2, where  # the handler returned at once, waiting for nothing
        assert time.monotonic() < deadline


def test_the_handler_is_installed_only_over_pythons_own(sigint_default):
    interrupt.install_lock_safe_sigint()
    assert signal.getsignal(signal.SIGINT) is interrupt.lock_safe_sigint
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job's ignored Ctrl-C stays ignored
    interrupt.install_lock_safe_sigint()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
