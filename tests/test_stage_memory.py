"""What a train archive's programs hold as CUDA graphs (runtime/graph_memory.py, scripts/stage_memory.py), on
the CPU: the static accounting agrees with what the programs return when they run, and a staged backward's
plan holds no more than the one-program plan plus its carries (issue 12.2)."""
from __future__ import annotations

import pytest
import torch

import aotfuse
from aotfuse.runtime.graph_memory import table, totals, train_memory
from aotfuse.specs import load_spec, random_inputs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def archives():
    model, inputs = load_spec("aotfuse.examples.gpt:demo_train(dropout=0.0)")
    return {n: aotfuse.build(model, inputs, train=True, targets=("sm_90",), step="split", backward_stages=n).data
            for n in (1, 3)}


def _returned_bytes(outs: list, ins: list) -> int:
    """Distinct storages the program returned, inputs passed through excluded."""
    mine = {t.untyped_storage().data_ptr() for t in ins if isinstance(t, torch.Tensor) and t.numel()}
    seen = {}
    for t in outs:
        s = t.untyped_storage()
        if t.numel() and s.data_ptr() not in mine:
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("stages", [1, 3])
def test_the_accounting_matches_what_each_program_returns(archives, stages):
    art = aotfuse.load(archives[stages], device="cpu")
    rows = {r.name: r for r in train_memory(art)}
    assert list(rows) == list(art.manifest.train.programs)
    pm = art.as_module()
    got = {}
    run = pm._run

    def spy(progs, name, ins, **kw):
        outs = run(progs, name, ins, **kw)
        got[name] = _returned_bytes(list(outs), ins)
        return outs
    pm._run = spy
    pm(*random_inputs(art.input_specs, device="cpu", seed=0)).backward()
    for name, r in rows.items():
        assert got[name] == r.outputs, name
    assert rows["forward"].saved_out > 0 and rows["forward"].grads == 0
    back = [r for r in rows.values() if r.name != "forward"]
    assert all(r.outputs == r.grads + r.carries_out for r in back)
    assert back[-1].carries_out == 0 and (stages == 1 or all(r.carries_out for r in back[:-1]))
    text = table(list(rows.values()))
    assert "held between steps" in text and "backward" in text


def test_a_staged_plan_holds_the_one_program_plan_plus_its_carries(archives):
    one = train_memory(aotfuse.load(archives[1], device="cpu"))
    staged = train_memory(aotfuse.load(archives[3], device="cpu"))
    t1, t3 = totals(one), totals(staged)
    assert len(staged) == 4 and t3.carries > 0 and t1.carries == 0
    # the same gradients, cut into stages; the shared arena no larger than the one backward's
    assert sum(r.grads for r in staged) == sum(r.grads for r in one)
    assert t3.arena <= t1.arena
    assert t3.held - t1.held <= t3.carries + (t3.static - t1.static)
    # what the captures allocate and free: with one pool for the backward stages, no more than one backward's
    assert t3.transient_max <= t1.transient_max < t3.transient_sum
