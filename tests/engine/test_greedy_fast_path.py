"""The greedy fast path of the in-graph verification (`trtllm/verify.py` `pick_tokens`): a step whose every request is
greedy takes the argmax branch of a TensorRT conditional on the batch-wide flag "some request samples", and never
the sampling path. Oracles: the golden loop's tokens, and the emulated conditional's ledger of the branch each step
took; breaking the sampling path must change a sampled batch and leave an all-greedy one exactly as it was."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.emulation.functional import Conditional, EmulationError, Network, PluginConfig, Tensor, net_guard
from dflash_trt.emulation.stand_ins import load_engine_module
from dflash_trt.executors.emulated import decode_batch
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model
from dflash_trt.sampling_rules import Sampling

PROMPTS = [[3, 4, 5, 6, 7], [9, 10], [11, 12, 13, 14]]
MAX_NEW = 12


def _bool(value: bool) -> Tensor:
    return Tensor(data=torch.tensor([value]))


def test_the_conditional_takes_one_branch_and_checks_them_as_tensorrt_does():
    network = Network(PluginConfig())
    with net_guard(network):
        one, two = Tensor(data=torch.ones(2, 1, dtype=torch.int32)), Tensor(data=torch.zeros(2, 1, dtype=torch.int32))
        assert Conditional(_bool(False)).add_output(one, two) is two
        assert Conditional(_bool(True)).add_output(one, two) is one
        with pytest.raises(EmulationError, match="one dtype and shape"):
            Conditional(_bool(True)).add_output(one, Tensor(data=torch.zeros(3, 1, dtype=torch.int32)))
        with pytest.raises(EmulationError, match="one bool condition"):
            Conditional(Tensor(data=torch.tensor([1, 0])))
    assert network.branches_taken == [False, True]


@pytest.fixture
def broken_sampling(monkeypatch):
    """The network's sampling path replaced by one that always draws token 0."""
    verify = load_engine_module().verify_drafts.__globals__

    def token_zero(logits, temperature, uniform, vocab_size):
        return verify["cast"](verify["argmax"](logits, 1, keepdim=True), "int32") * 0

    monkeypatch.setitem(verify, "sample_rows", token_zero)


def _raw(temperature: float, seed: int) -> Sampling:
    """A request carrying `temperature` into the engine as given: `Sampling` maps a tiny one to 0 at the edge, but
    a client of TensorRT-LLM's own executor hands the engine the raw value, so the in-graph rule must hold alone."""
    sampling = Sampling(temperature=1.0, seed=seed)
    object.__setattr__(sampling, "temperature", temperature)
    return sampling


def _decode(ckpt, temperatures):
    engine = EmulatedEngine(ckpt, max_batch_size=3, tokens_per_block=16)
    sampling = [_raw(t, seed) for t, seed in zip(temperatures, [5, 6, 7], strict=True)]
    results = decode_batch(engine, PROMPTS, MAX_NEW, [1], sampling=sampling)
    return engine, [r.output_ids for r in results]


# Temperatures below sampling_rules.MIN_SAMPLING_TEMPERATURE (1e-5 in float32) are greedy, in the fast path too.
@pytest.mark.parametrize("temperatures", [[0.0, 0.0, 0.0], [1e-40, 9.99e-6, 0.0]], ids=["zero", "too-small-to-invert"])
def test_an_all_greedy_batch_never_takes_the_sampling_branch(converted, broken_sampling, temperatures):
    golden = speculative_generate(load_golden_model(converted), PROMPTS, MAX_NEW, [1])
    runtime, tokens = _decode(converted, temperatures)
    assert tokens == [g.output_ids for g in golden]  # a broken sampling path changed nothing
    assert runtime.stats.steps > 0 and runtime.stats.sampling_steps == 0


@pytest.mark.parametrize("temperature", [0.9, 1e-5], ids=["0.9", "the-minimum"])
def test_one_sampled_request_takes_the_whole_batch_down_the_sampling_path(converted, broken_sampling, temperature):
    runtime, tokens = _decode(converted, [0.0, temperature, 0.0])
    assert runtime.stats.sampling_steps == runtime.stats.steps  # every step has the sampled request in flight
    assert set(tokens[1]) == {0}  # its tokens come from the (broken) sampling path
