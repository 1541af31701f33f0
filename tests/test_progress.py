"""The root's progress bar: drawn when asked or on a TTY, silent otherwise."""
import io

from hpcsync.observe.progress import Progress


def test_progress_draws_when_enabled():
    s = io.StringIO()
    bar = Progress("merging x", 2 * 2**20, enabled=True, stream=s)
    bar.update(2**20)
    bar.update(2**20)
    bar.close()
    out = s.getvalue()
    assert "merging x 100.0% 2.0 MiB/2.0 MiB" in out and out.endswith("\n")


def test_progress_off_when_not_a_tty_or_asked(monkeypatch):
    s = io.StringIO()  # not a TTY
    bar = Progress("m", 100, stream=s)
    bar.update(100)
    bar.close()
    assert s.getvalue() == ""

    class Tty(io.StringIO):
        def isatty(self):
            return True

    t = Tty()
    monkeypatch.setenv("HPCSYNC_PROGRESS", "0")
    bar = Progress("m", 100, stream=t)
    bar.update(100)
    bar.close()
    assert t.getvalue() == ""
