"""The launcher's stdout/stderr falls back to `<exp>/logs/launcher.out` when its reader is gone
(launcher/console.py). A real pipe whose read end is closed: writes raise BrokenPipeError, as
when `tandem run ... | head` has read its lines (the run itself: tests/integration/e2e/
test_launcher_terminal.py)."""
from __future__ import annotations

import io
import os

from tandem.launcher.console import Console, Fallback


def _closed_pipe() -> io.TextIOWrapper:
    read, write = os.pipe()
    os.close(read)
    return io.TextIOWrapper(os.fdopen(write, "wb"), line_buffering=True)


def test_the_first_failed_write_goes_to_the_fallback_with_a_notice_and_so_does_the_rest(tmp_path):
    stream = _closed_pipe()
    fallback = Fallback(tmp_path / "logs" / "launcher.out")
    out = Console(stream, fallback, "stdout")
    assert out.isatty() is False
    out.write("step 1/4\n")
    out.flush()
    print("step 2/4", file=out, flush=True)
    text = fallback.path.read_text().splitlines()
    assert "the launcher's stdout is gone" in text[0] and "Broken pipe" in text[0]
    assert text[1:] == ["step 1/4", "step 2/4"]
    # The old stream's descriptor now writes nowhere: its buffer cannot fail again at exit.
    stream.write("left in its buffer\n")
    stream.flush()


def test_a_working_stream_is_written_through_and_no_file_is_made(tmp_path):
    read, write = os.pipe()
    stream = io.TextIOWrapper(os.fdopen(write, "wb"))
    fallback = Fallback(tmp_path / "launcher.out")
    out = Console(stream, fallback, "stdout")
    out.write("step 1/4\n")     # written through at once, not left in a buffer
    assert os.read(read, 100) == b"step 1/4\n"
    assert not fallback.path.exists() and out.fileno() == write
    os.close(read)
    stream.close()


def test_stdout_and_stderr_share_one_file(tmp_path):
    fallback = Fallback(tmp_path / "launcher.out")
    out, err = Console(_closed_pipe(), fallback, "stdout"), Console(_closed_pipe(), fallback, "stderr")
    out.write("progress\n")
    err.write("a warning\n")
    text = fallback.path.read_text()
    assert "stdout is gone" in text and "stderr is gone" in text
    assert text.index("progress") < text.index("stderr is gone") < text.index("a warning")


def test_when_the_fallback_cannot_be_written_either_the_output_is_dropped_not_the_run(tmp_path):
    (tmp_path / "not-a-dir").write_text("")
    out = Console(_closed_pipe(), Fallback(tmp_path / "not-a-dir" / "launcher.out"), "stdout")
    assert out.write("step 1/4\n") == len("step 1/4\n")
    out.flush()
