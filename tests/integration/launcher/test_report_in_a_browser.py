"""The HTML report as a person sees it: opened in headless Chromium (Debian's
chromium-headless-shell, which `make install` adds when it can), its screenshot holds the
rendered figure, not a blank or broken page; and the report of a real 10-step run with
evaluation off (tests/support/recorded_run.py) shows its title and why its panels are empty."""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from PIL import Image
from recorded_run import write_recorded_run
from synthetic_run import write_synthetic_run

from tandem.launcher.report import write_report
from tandem.services.protocol import ExpDir

BROWSER = shutil.which("chromium-headless-shell") or shutil.which("chromium")


def browse(page, *how: str) -> subprocess.CompletedProcess:
    return subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *how,
                           page.as_uri()], check=True, capture_output=True, text=True, timeout=60)


def screenshot(page, shot, size="1200,1800") -> Image.Image:
    browse(page, f"--screenshot={shot}", f"--window-size={size}")
    return Image.open(shot).convert("RGB")


needs_browser = pytest.mark.skipif(BROWSER is None, reason="no headless Chromium (apt-get install chromium-headless-shell)")


@needs_browser
def test_the_report_page_renders_its_figure(tmp_path):
    exp = ExpDir(tmp_path / "run")
    write_synthetic_run(exp, n_steps=40)
    _, page, _ = write_report(exp)
    image = screenshot(page, tmp_path / "shot.png")
    assert image.size == (1200, 1800)
    pixels = np.asarray(image).reshape(-1, 3).astype(int)
    inked = float((pixels != 255).any(axis=1).mean())
    colours = len(np.unique(pixels, axis=0))
    # The figure's panels (axes, bars, curves) cover a good part of the page in many colours; a
    # blank page, a missing image or a bare error text does not.
    assert inked > 0.10, f"only {inked:.1%} of the page is not white"
    assert colours > 200, f"only {colours} distinct colours"
    # The red of the held-out curve and the blue of the rollout bars made it to the screen.
    r, g, b = pixels.T
    assert ((r > 180) & (g < 80) & (b < 80)).any()
    assert ((b > 150) & (r < 100)).any()


@needs_browser
def test_a_ten_step_run_without_evaluation_explains_itself_in_the_browser(tmp_path):
    exp = write_recorded_run(ExpDir(tmp_path / "run"))
    png, page, counts = write_report(exp)
    # What the browser parsed and shows as text: the title, the run's file, date and commit,
    # and why the held-out panel is empty.
    dom = browse(page, "--dump-dom").stdout
    assert "<title>Tandem run math-tiny</title>" in dom and "<h1>Tandem run math-tiny</h1>" in dom
    assert "config: configs/math-tiny.yaml · started: 2026-11-26 13:42 UTC · commit: 0e65a8c6aa7f" in dom
    assert "evaluation off (rollout.eval_size and rollout.eval_every are 0)" in dom
    # What it draws: the heading in dark text at the top of the page, then the figure, whose
    # own title band (the run's name, file and commit above the panels) is inked, in the
    # screenshot as in the PNG the page embeds.
    image = screenshot(page, tmp_path / "shot.png", size="1200,2000")
    pixels = np.asarray(image).astype(int)
    assert (pixels[:60].max(axis=2) < 80).sum() > 200, "no dark heading text at the top of the page"
    figure = np.asarray(Image.open(png).convert("L")) < 128
    top = int(np.argmax(figure.mean(axis=1) > 0.3))     # the first row of the panels' frames
    width = figure.shape[1]
    # Above the frames, panel titles sit over their columns; only the figure's title is centred.
    assert figure[:top, width * 46 // 100: width * 54 // 100].sum() > 200, "no title above the panels"
    inked = float((pixels.reshape(-1, 3) != 255).any(axis=1).mean())
    assert inked > 0.10 and len(np.unique(pixels.reshape(-1, 3), axis=0)) > 200
    assert counts["held_out_points"] == 0 and counts["steps"] == 10
