"""eval.exact: which verification the harness picks per device, dtype and decoding, and the exact path as a GPU
would take it.

No CUDA exists here. What is imitated, and how: the choice is computed for `torch.device("cuda")` (a device object
only; no tensor is placed there), and the exact path that choice turns on is then run on CPU tensors with the
defaults it takes off the CPU (`upcasts_attention` for a cuda device: bf16 row-wise attention, no float32 upcast).
What a GPU alone can tell — that cuBLAS and the SDPA kernels keep a row's bits under the padding `exact_base_rows`
probes — is not tested here; `jobs/gpu_smoke` checks it end to end (lossless) on a GPU."""

import pytest
import torch

from flashdraft.target import EXACT_ATTENTION, make_verification_exact, needs_exact_verification, resolve_exact
from flashdraft.target.exact import upcasts_attention
from tests.test_speculative import VOCAB, one_thread, tiny_target  # noqa: F401 (one_thread: autouse fixture)

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize("device", [CUDA, CPU, "cuda:1", "cpu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_auto_verifies_exactly_wherever_greedy_outputs_are_compared(device, dtype):
    """auto, greedy: on, on CUDA as on CPU, in bf16 and in float32 (a one-token step and a k-token verify take
    other kernels on both); auto, sampling: off (outputs compared in distribution: the target's own kernels)."""
    assert needs_exact_verification(dtype, device)
    exact, why = resolve_exact("auto", dtype, device, greedy=True)
    assert exact is True and why == f"auto: greedy on {torch.device(device).type} in {str(dtype)[6:]}"
    exact, why = resolve_exact("auto", dtype, device, greedy=False)
    assert exact is False and why.startswith("auto: sampling")


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("device", [CUDA, CPU])
def test_on_and_off_are_taken_as_set(device, greedy):
    assert resolve_exact("on", torch.bfloat16, device, greedy=greedy) == (True, "eval.exact=on")
    assert resolve_exact("OFF", torch.bfloat16, device, greedy=greedy) == (False, "eval.exact=off")


def test_a_bad_setting_or_device_is_refused_by_name():
    with pytest.raises(ValueError, match=r"eval.exact must be one of auto, on, off, got 'exactly'"):
        resolve_exact("exactly", torch.float32, CPU, greedy=True)
    with pytest.raises(RuntimeError, match="gpu"):
        resolve_exact("auto", torch.float32, "gpu", greedy=True)


def test_row_wise_attention_upcasts_only_on_a_cpu():
    assert upcasts_attention(CUDA) is False and upcasts_attention("cuda:3") is False
    from flashdraft.target import cpu_has_bf16_tiles

    assert upcasts_attention(CPU) is (not cpu_has_bf16_tiles())


def test_the_exact_path_cuda_takes_gives_a_verify_the_bits_of_one_token_steps():
    """bf16, as the harness serves on a GPU: the decision for a cuda device turns exact verification on with bf16
    row-wise attention (no upcast off the CPU); run here on CPU tensors, a 16-token verify then gives bit for bit
    the logits of 16 one-token steps at every context length tried."""
    exact, _ = resolve_exact("auto", torch.bfloat16, CUDA, greedy=True)
    assert exact
    target = make_verification_exact(
        tiny_target("llama").to(torch.bfloat16), rows=16, fp32_attention=upcasts_attention(CUDA)
    )
    assert target.config._attn_implementation == EXACT_ATTENTION
    ids = torch.randint(0, VOCAB - 2, (1, 120), generator=torch.Generator().manual_seed(5))
    for start in range(40, 104, 7):
        out = target(ids[:, :start], use_cache=True)
        block = target(ids[:, start : start + 16], past_key_values=out.past_key_values, use_cache=True).logits[0]
        out.past_key_values.crop(-16)
        steps = [
            target(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True).logits[0, -1]
            for t in range(start, start + 16)
        ]
        assert torch.equal(block, torch.stack(steps)), start
