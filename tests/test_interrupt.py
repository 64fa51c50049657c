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
