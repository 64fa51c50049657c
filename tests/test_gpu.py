"""The CUDA path: deterministic numerics, both trainers, CPU/GPU agreement, resume, `flockfl run`.

Device-parametrised tests run on three devices:

- ``cuda``: a real GPU; marked ``gpu`` and skipped without one (``pytest -m gpu`` selects them);
- ``fake_cuda``: ``tests/fakecuda.py``, a CPU emulation of a GPU that enforces CUDA's device
  rules (same-device operands, no CPU generator for GPU draws, no ``.numpy()`` of a GPU
  tensor, the ops that raise under deterministic mode) with real CPU arithmetic, so results
  must equal a CPU run bit for bit; runs in plain CI and catches device bugs without a GPU;
- ``cpu``: the same test bodies on the CPU, so they cannot rot where no GPU ever runs them.

On CPU-only CI the cpu and fake_cuda params run a reduced set of algorithms; the cuda params
run every registered algorithm.
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest
import torch
import yaml

import fakecuda
from conftest import assert_resume_bit_identical, assert_trainers_agree, last_json, rel_err, run_flock, tiny_config
from flockfl.algorithms import ALGORITHMS
from flockfl.config import deep_merge
from flockfl.experiments import validate

HAS_CUDA = torch.cuda.is_available()
GPU_MARKS = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]
CUDA = pytest.param("cuda", marks=GPU_MARKS, id="cuda")
FAKE = pytest.param("fake_cuda", marks=pytest.mark.skipif(not fakecuda.available(),
                                                        reason="this torch cannot run the CUDA emulation"), id="fake_cuda")
CPU = pytest.param("cpu", id="cpu")

# settings some algorithms need on the tiny config
ALGO_CONFIG = {
    "ccfl": {"train": {"local_steps": 4}},
    "flis_dc": {"algorithm": {"server_data_size": 50, "beta": 0.5}, "partition": {"server_holdout": 50}},
    "flis_hc": {"algorithm": {"server_data_size": 50, "beta": 0.5}, "partition": {"server_holdout": 50}},
    "pacfl": {"algorithm": {"cut": "largest_gap"}},  # β has no default (the data sets it)
}
REDUCED = ("fedavg", "scaffold", "ifca", "fedadam")  # the cpu and fake_cuda params (plain CI)
DEVICE_TYPE = {"cpu": "cpu", "cuda": "cuda", "fake_cuda": fakecuda.GPU.type}


@pytest.fixture(autouse=True)
def restore_numerics():
    """resolve_device('cuda') sets process-wide CUDA numerics: put them back after each test."""
    b = torch.backends
    saved = (b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32, b.cudnn.benchmark, b.cudnn.deterministic,
             torch.are_deterministic_algorithms_enabled())
    yield
    (b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32, b.cudnn.benchmark, b.cudnn.deterministic) = saved[:4]
    torch.use_deterministic_algorithms(saved[4])


@contextlib.contextmanager
def on(device: str):
    """Runs inside put their data and models on ``device``; yields the ``train.device`` value."""
    if device == "fake_cuda":
        with fakecuda.fake_cuda() as dev, fakecuda.patch_resolve_device(dev):
            yield "cpu"
    else:
        yield device


def config(device: str, algorithm: str = "fedavg", model: str = "mlp", **over) -> dict:
    raw = tiny_config(algorithm={"name": algorithm}, model={"name": model, "hidden": 16}, train={"device": device})
    return deep_merge(deep_merge(raw, ALGO_CONFIG.get(algorithm, {})), over)


def models_on(state, device: str) -> bool:
    return all(v.device.type == DEVICE_TYPE[device] for v in state.models.values())


def trained_everyone(state) -> bool:
    """No client was dropped: a device error inside training makes ``train_stage`` drop the
    shard's clients instead of failing, and an untrained run agrees with anything."""
    return bool(state.history) and all(h["clients_dropped"] == 0 and h["clients"] > 0 for h in state.history)


def cases(*groups) -> list:
    """pytest params from (device param, [argument tuples]) groups, ids "device-arg-arg"."""
    return [pytest.param(d.values[0], *args, id="-".join([d.id, *args]), marks=d.marks) for d, many in groups for args in many]


# ---------------------------------------------------------------------- numerics settings (no GPU needed)


def test_resolve_device_turns_on_deterministic_cuda_numerics(monkeypatch):
    import os

    from flockfl.engine import runtime

    b = torch.backends
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") in (":4096:8", ":16:8")  # set when flockfl.engine is imported
    assert runtime.resolve_device("cuda").type == "cuda"
    assert (b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32, b.cudnn.benchmark) == (False, False, False)
    assert b.cudnn.deterministic and torch.are_deterministic_algorithms_enabled()
    assert runtime.resolve_device("auto").type == "cuda"

    monkeypatch.setattr(runtime, "_FAST_MATH_WARNED", [False])
    with pytest.warns(RuntimeWarning, match="no longer bit-identical"):
        runtime.resolve_device("cuda", fast_math=True)
    assert (b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32, b.cudnn.benchmark) == (True, True, True)
    assert not b.cudnn.deterministic and not torch.are_deterministic_algorithms_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runtime.resolve_device("cuda", fast_math=True)  # warned once already


def test_resolve_device_leaves_cpu_numerics_alone(monkeypatch):
    from flockfl.engine import runtime

    b = torch.backends
    b.cuda.matmul.allow_tf32, b.cudnn.deterministic = True, False
    torch.use_deterministic_algorithms(False)
    for name, fast in (("cpu", False), ("cpu", True)):
        assert runtime.resolve_device(name, fast).type == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runtime.resolve_device("auto").type == "cpu"
    assert b.cuda.matmul.allow_tf32 and not b.cudnn.deterministic and not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(RuntimeError, match="no CUDA device"):
        runtime.resolve_device("cuda")


@pytest.mark.parametrize("device", [FAKE, CUDA])
def test_segment_mean_is_deterministic_safe(device):
    from flockfl.engine.functional import segment_mean

    values = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    seg = torch.tensor([0, 2, 2, 0, 2, 3])
    with on(device):
        dev = fakecuda.GPU if device == "fake_cuda" else torch.device("cuda")
        torch.use_deterministic_algorithms(True)
        means, counts = segment_mean(values.to(dev), seg.to(dev), 5)
        means, counts = means.cpu(), counts.cpu()
    np.testing.assert_array_equal(counts.numpy(), [2, 0, 3, 1, 0])
    np.testing.assert_allclose(means.numpy(), [[1.5, 0, 7 / 3, 5, 0], [7.5, 0, 25 / 3, 11, 0]], rtol=1e-6)


# ---------------------------------------------------------------------- initialisation


@pytest.mark.parametrize("model_name", ["mlp", "lenet5_bn"])
@pytest.mark.parametrize("device", [FAKE, CUDA])
def test_init_params_draws_on_the_cpu_whatever_the_device(device, model_name):
    """A model on the GPU starts from exactly the CPU draws (the generator stays a CPU one)."""
    from flockfl.rng import torch_generator
    from models import build_model, init_params

    model = build_model(model_name, (1, 8, 8), 10, 16)
    cpu = init_params(model, torch_generator(5, client=1, purpose="init"))
    with on(device):
        dev = fakecuda.GPU if device == "fake_cuda" else torch.device("cuda")
        gpu = init_params(model.to(dev), torch_generator(5, client=1, purpose="init"))
        assert all(v.device.type == dev.type for v in gpu.values())
        gpu = {k: v.cpu() for k, v in gpu.items()}
    for k in cpu:
        assert torch.equal(cpu[k], gpu[k]), k


# ---------------------------------------------------------------------- engines on the device


REDUCED_CASES = [(a, "mlp") for a in REDUCED] + [("fedavg", "lenet5")]
ALL_CASES = [(a, "mlp") for a in ALGORITHMS] + [("fedavg", "lenet5"), ("ifca", "lenet5"), ("fedavg", "lenet5_bn")]


# the emulated GPU's LeNet-5 (8-10 s: every convolution through the emulation) is the full suite's;
# the fast tier keeps the emulated MLP cases and LeNet-5 on the CPU
FAKE_SLOW = pytest.param("fake_cuda", marks=[*FAKE.marks, pytest.mark.slow], id="fake_cuda")


@pytest.mark.parametrize("device,algorithm,model", cases((CPU, REDUCED_CASES), (FAKE, [c for c in REDUCED_CASES if c[1] == "mlp"]),
                                                         (FAKE_SLOW, [c for c in REDUCED_CASES if c[1] != "mlp"]),
                                                         (CUDA, ALL_CASES)))
def test_trainers_agree_on_the_device(device, algorithm, model, tmp_path):
    """The vectorised and reference trainers give the same models and clusters on the device
    (deterministic numerics: float rounding only, TF32 off)."""
    tol = 1e-4 if (device == "cuda" and model != "mlp") else 1e-5
    with on(device) as dev:
        ref, vec = assert_trainers_agree(lambda e: validate(config(dev, algorithm, model, train={"engine": e, "rounds": 2})),
                                         tmp_path, tol)
        assert models_on(ref, device) and models_on(vec, device)
        assert trained_everyone(ref) and trained_everyone(vec)
        assert [h["round"] for h in vec.history] == [1, 2] and np.isfinite(vec.history[-1]["loss"])


# ---------------------------------------------------------------------- CPU against the device

AGREE = [(a, m) for a in ("fedavg", "scaffold", "ifca") for m in ("mlp", "lenet5")] + [("fedavg", "lenet5_bn")]
AGREE_FAKE = [("fedavg", "lenet5"), ("scaffold", "mlp"), ("ifca", "mlp")]  # plain CI: the emulation is slower


@pytest.mark.parametrize("device,algorithm,model", cases((FAKE, AGREE_FAKE), (CUDA, AGREE)))
def test_cpu_and_device_runs_agree(device, algorithm, model, tmp_path):
    """Three rounds on the CPU and on the device: the same draws (all made on the CPU), so the
    same models up to float rounding and the same clusters; the emulation is bit-identical (the
    convolutions in one layout: ``train.conv_layout=auto`` is channels-last on a CPU only)."""
    from flockfl.rounds import prepare, run_rounds

    layout = {"train": {"conv_layout": "channels_last"}} if device == "fake_cuda" else {}
    cpu = run_rounds(prepare(validate(config("cpu", algorithm, model, **layout)), tmp_path))
    with on(device) as dev:
        gpu = run_rounds(prepare(validate(config(dev, algorithm, model, **layout)), tmp_path))
        assert models_on(gpu, device) and trained_everyone(gpu)
        gpu_models = {k: v.cpu() for k, v in gpu.models.items()}
        gpu_digest = gpu.digest()
    np.testing.assert_array_equal(gpu.assignments, cpu.assignments)
    if device == "fake_cuda":
        assert gpu_digest == cpu.digest()
        assert gpu.history[-1] == {**cpu.history[-1], "round_time_s": gpu.history[-1]["round_time_s"]}
    else:
        assert rel_err(gpu_models, cpu.models) < 1e-4
        assert abs(gpu.history[-1]["accuracy"] - cpu.history[-1]["accuracy"]) <= 0.02


# ---------------------------------------------------------------------- resume


RESUME_REDUCED = [("fedadam",), ("scaffold",), ("fedac",)]
RESUME = [("fedavg",), ("fedadam",), ("scaffold",), ("ifca",), ("ccfl",), ("fedsplit",), ("flexcfl",), ("fedac",)]


@pytest.mark.parametrize("device,algorithm", cases((CPU, RESUME_REDUCED), (FAKE, RESUME_REDUCED), (CUDA, RESUME)))
def test_resume_is_bit_identical_on_the_device(device, algorithm, tmp_path):
    """Run 3 rounds straight, or 1 round → checkpoint (CPU tensors) → load → 2 more rounds on
    the device: identical digests and last-round metrics, and the resumed run's models and
    server tensors are back on the device."""
    with on(device) as dev:
        cfg = validate(config(dev, algorithm))
        full, resumed = assert_resume_bit_identical(cfg, tmp_path, until=1)
        assert models_on(resumed, device) and trained_everyone(full)
        if algorithm == "fedadam":
            assert all(v.device.type == DEVICE_TYPE[device] for v in resumed.algo["m"].values())


# ---------------------------------------------------------------------- the CLI


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_flock_run_on_cuda_matches_the_plain_loop(workdir, tmp_path):
    """`flockfl run --set train.device=cuda` end to end (Prefect flow, checkpoints): its state
    digest equals the plain loop's on the same GPU (deterministic numerics across processes)."""
    from flockfl.rounds import prepare, run_rounds

    raw = config("cuda", "ifca", train={"rounds": 2})
    raw["algorithm"].update({"k": 2, "init": "random"})
    raw["tracking"] = {"enabled": False}
    (workdir / "gpu.yaml").write_text(yaml.safe_dump(raw))
    res = run_flock(["run", "gpu.yaml", "--run-dir", "runs/gpu", "--json", "--set", "train.device=cuda"], workdir)
    assert res.returncode == 0, res.stderr
    out = last_json(res.stdout)
    assert out["rounds"] == 2 and 0 < out["metrics"]["accuracy"] <= 1
    plain = run_rounds(prepare(validate(raw), tmp_path))
    assert out["state_sha256"] == plain.digest()
