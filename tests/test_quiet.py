"""A model export's quiet stderr is its own thread's: what other threads print meanwhile stays
(a sweep's log lines and flockfl repro's estimate were lost while an export ran)."""
import sys
import threading

from tasks.quiet import quiet_stderr


def test_only_the_quiet_thread_is_silenced(capsys):
    inside, done = threading.Event(), threading.Event()

    def export():
        with quiet_stderr():
            print("Created version '1' of model", file=sys.stderr, flush=True)
            inside.set()
            done.wait(10)
            print("still quiet", file=sys.stderr)

    t = threading.Thread(target=export)
    t.start()
    inside.wait(10)
    print("repro: run 1/4 took 3 s", file=sys.stderr, flush=True)  # another thread, during the export
    done.set()
    t.join()
    print("after", file=sys.stderr)
    err = capsys.readouterr().err
    assert "repro: run 1/4 took 3 s" in err and "after" in err
    assert "Created version" not in err and "still quiet" not in err
    assert not type(sys.stderr).__name__ == "_Proxy"  # the stream is put back when no thread is quiet


def test_nested_and_overlapping_quiet_blocks_put_the_stream_back(capsys):
    before = sys.stderr
    with quiet_stderr():
        with quiet_stderr():
            print("a", file=sys.stderr)
        print("b", file=sys.stderr)
    print("c", file=sys.stderr)
    assert sys.stderr is before
    assert capsys.readouterr().err == "c\n"
