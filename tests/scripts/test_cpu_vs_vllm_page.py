"""scripts/cpu_vs_vllm_page.py: a rerun of bench_vs_vllm_cpu.py replaces the figures of
docs/benchmarks/cpu_vs_vllm.md but keeps what a person wrote between the notes markers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def page_module():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location(
        "cpu_vs_vllm_page", ROOT / "scripts" / "cpu_vs_vllm_page.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_page_is_its_json_rendered_around_its_notes() -> None:
    page = page_module()
    path = ROOT / "docs" / "benchmarks" / "cpu_vs_vllm.md"
    report = json.loads((ROOT / "docs" / "benchmarks" / "cpu_vs_vllm.json").read_text())
    notes = page.kept_notes(path)
    assert "## " in notes  # the page's hand-written sections are inside the markers
    assert page.render(report, notes) == path.read_text()


def test_a_rerun_keeps_the_notes_and_replaces_the_figures(tmp_path: Path) -> None:
    page = page_module()
    report = json.loads((ROOT / "docs" / "benchmarks" / "cpu_vs_vllm.json").read_text())
    out = tmp_path / "page.md"
    assert page.kept_notes(out) == ""  # no page yet
    out.write_text(page.render(report))  # a first run: empty markers
    assert page.kept_notes(out) == ""
    written = out.read_text().replace(page.NOTES_END, "A note on the run.\n" + page.NOTES_END)
    out.write_text(written)
    report["meta"]["date"] = "a later run"
    out.write_text(page.render(report, page.kept_notes(out)))  # the rerun, as _write does it
    text = out.read_text()
    assert "A note on the run." in text and "a later run" in text
    assert text.count(page.NOTES_BEGIN) == 1 and text.count(page.NOTES_END) == 1
