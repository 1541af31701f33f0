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


def test_progress_under_a_launcher_prints_a_line_now_and_then(monkeypatch):
    """Under mpiexec or srun stderr is a pipe: a long copy says how far it is, one plain line
    every LINE_EVERY_S seconds (no carriage returns), a quick one says nothing."""
    from hpcsync.observe import progress

    now = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    s = io.StringIO()  # not a TTY
    bar = Progress("staging data", 100 * 2**20, stream=s)
    for _ in range(100):
        now[0] += 0.5
        bar.update(2**20)
    bar.close()
    lines = s.getvalue().splitlines()
    assert "\r" not in s.getvalue() and len(lines) == 50 // progress.LINE_EVERY_S, lines
    assert lines[0].startswith("staging data  ") and "%" in lines[0] and lines[-1].startswith("staging data 100.0%"), lines
    quick = io.StringIO()
    bar = Progress("staging data", 100, stream=quick)
    bar.update(100)
    bar.close()
    assert quick.getvalue() == ""
