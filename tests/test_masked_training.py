"""fastdl.sparsity.MaskedTraining keeps 2:4 masks by masking gradients only: with SGD (momentum, nesterov, weight
decay), Adam and AdamW (weight decay, amsgrad, fused) the pruned weights stay exactly zero for 100 steps with no
re-masking (the periodic check is turned off), the trained weights equal plain training with the gradients masked by
hand, also in 2-process DDP; an optimizer not known to keep zeros is re-masked after every step; the safety net catches
weights moved by something else; an optimizer state built before pruning is masked; a weight replaced after the start
is hooked after the next step."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from _ddp import run_ddp
from torch import nn

import fastdl.ops.sparse24 as sp  # noqa: F401  (registers the ops)
from fastdl import sparsity
from fastdl.nn import FusedLinear

STEPS = 100

OPTIMIZERS = {
    "sgd_momentum_wd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-2),
    "sgd_nesterov_dampening": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "adamw_wd": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adamw_wd_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "adam_l2_amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.05, amsgrad=True),
    "adam_foreach_maximize": lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True, maximize=True),
}


def _model(seed=0):
    """Odd widths, a FusedLinear and plain Linears; the last layer (in_features 10) is not pruned."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(36, 52), nn.GELU(), FusedLinear(52, 28, activation="relu"), nn.Linear(28, 10),
                          nn.Linear(10, 3))  # fmt: skip
    sparsity.prune(model)
    return model


def _batches(n, rows=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 36, generator=g), torch.randint(0, 3, (rows,), generator=g)) for _ in range(n)]


def _pruned(model):
    return {n: m for n, m in model.named_modules() if sparsity.is_pruned(m)}


def _off_mask_nonzeros(model) -> int:
    return sum(int(torch.count_nonzero(m.weight.detach()[~sparsity.get_mask(m)])) for m in _pruned(model).values())


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_masks_exact_after_100_steps_by_masked_gradients_alone(opt_name):
    model, ref = _model(), _model()
    opt, ref_opt = OPTIMIZERS[opt_name](model.parameters()), OPTIMIZERS[opt_name](ref.parameters())
    masks = {n: sparsity.get_mask(m).clone() for n, m in _pruned(model).items()}
    assert set(masks) == {"0", "2", "3"}
    start = {n: m.weight.detach().clone() for n, m in _pruned(model).items()}
    mt = sparsity.MaskedTraining(model, opt, check_every=0)  # no periodic check: only the gradient masking acts
    assert not mt.remask_every_step, mt.remask_reason
    for step, (x, y) in enumerate(_batches(STEPS)):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for n, mask in masks.items():
            g = model.get_submodule(n).weight.grad
            assert int(torch.count_nonzero(g[~mask])) == 0 and int(torch.count_nonzero(g[mask])) > 0, (n, step)
        opt.step()
        # the reference: plain training with the gradients masked by hand, nothing else
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        with torch.no_grad():
            for n, mask in masks.items():
                ref.get_submodule(n).weight.grad.mul_(mask)
        ref_opt.step()
    assert _off_mask_nonzeros(model) == 0  # before remove(): its last check would hide a drift
    assert mt.remask_reason is None and mt.steps == STEPS
    for n, m in _pruned(model).items():
        assert sparsity.is_2_4(m.weight) and torch.equal(sparsity.get_mask(m), masks[n])
        assert not torch.equal(m.weight.detach(), start[n])  # it trained
    for (k, v), (k2, v2) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k
    assert mt.check() == 0
    mt.remove()


class _DecayTowardsOne(torch.optim.SGD):
    """An optimizer that moves weights with zero gradients: w += 1e-3 * (1 - w) after the SGD step."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(1 - p, alpha=1e-3)
        return loss


def test_unknown_optimizer_is_remasked_after_every_step():
    model = _model()
    opt = _DecayTowardsOne(model.parameters(), lr=0.05)
    with sparsity.MaskedTraining(model, opt, check_every=0) as mt:
        assert mt.remask_every_step and "_DecayTowardsOne" in mt.remask_reason
        for x, y in _batches(5):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            assert _off_mask_nonzeros(model) == 0
    for eps_zero in (torch.optim.Adam, torch.optim.AdamW):
        mt = sparsity.MaskedTraining(model, eps_zero(model.parameters(), eps=0.0))
        assert mt.remask_every_step and "eps = 0.0" in mt.remask_reason, mt.remask_reason
        mt.remove()
    mt = sparsity.MaskedTraining(model, torch.optim.RMSprop(model.parameters()))  # not on the list: re-masked
    assert mt.remask_every_step and "RMSprop" in mt.remask_reason
    mt.remove()


def test_safety_net_catches_weights_moved_by_something_else():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mt = sparsity.MaskedTraining(model, opt, check_every=10)
    batches = _batches(25)
    for x, y in batches[:9]:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    with torch.no_grad():  # a stray update outside the optimizer (an EMA swap, a hand-written step, ...)
        model[0].weight.add_(1e-3)
    assert _off_mask_nonzeros(model) > 0
    x, y = batches[9]
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    with pytest.warns(RuntimeWarning, match=r"pruned weight\(s\) found off zero after 10 step"):
        opt.step()  # step 10: the check
    assert _off_mask_nonzeros(model) == 0 and mt.remask_every_step
    for x, y in batches[10:]:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        with torch.no_grad():
            model[2].weight.add_(1e-3)
        assert _off_mask_nonzeros(model) > 0  # moved after the step: caught after the next step, or by remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # already in per-step mode: no second warning
        mt.remove()
    assert _off_mask_nonzeros(model) == 0


@pytest.mark.parametrize("opt_name", ["sgd_momentum_wd", "adamw_wd"])
def test_optimizer_state_from_before_pruning_is_masked(opt_name):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(36, 52), nn.GELU(), nn.Linear(52, 3))
    opt = OPTIMIZERS[opt_name](model.parameters())
    for x, y in _batches(5):  # dense training first: momentum / moments non-zero everywhere
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    sparsity.prune(model)
    with sparsity.MaskedTraining(model, opt, check_every=0) as mt:
        assert not mt.remask_every_step
        for x, y in _batches(20, seed=2):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        assert _off_mask_nonzeros(model) == 0


def test_without_optimizer_gradients_masked_and_checked_on_remove():
    model = _model()
    mt = sparsity.MaskedTraining(model)
    x, y = _batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    for m in _pruned(model).values():
        assert int(torch.count_nonzero(m.weight.grad[~sparsity.get_mask(m)])) == 0
    with torch.no_grad():
        model[3].weight.add_(1.0)
    with pytest.warns(RuntimeWarning, match="no optimizer given"):
        mt.remove()
    assert _off_mask_nonzeros(model) == 0


def test_check_every_argument_errors():
    model = _model()
    with pytest.raises(TypeError, match="check_every must be an int, got float"):
        sparsity.MaskedTraining(model, check_every=1.5)
    with pytest.raises(ValueError, match="check_every must be >= 0.*got -1"):
        sparsity.MaskedTraining(model, check_every=-1)


# ------------------------------------------------------------------------------------------------------ DDP
DDP_RUNS = ("sgd_momentum_wd", "adamw_wd", "sgd_bucket_view")


def _ddp_worker(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for run in DDP_RUNS:
        model = _model()  # same seed on both ranks: same weights, same masks
        ddp = DDP(model, gradient_as_bucket_view=run == "sgd_bucket_view")
        opt = OPTIMIZERS["sgd_momentum_wd" if run == "sgd_bucket_view" else run](ddp.parameters())
        mt = sparsity.MaskedTraining(ddp, opt, check_every=0)
        grads_ok = True
        for x, y in _batches(STEPS, seed=10 + rank):  # different data on each rank
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            grads_ok &= all(int(torch.count_nonzero(m.weight.grad[~sparsity.get_mask(m)])) == 0
                            for m in _pruned(model).values())  # fmt: skip
            opt.step()
        out[run] = {"off_mask_nonzeros": _off_mask_nonzeros(model), "grads_ok": grads_ok,
                    "remask_every_step": mt.remask_every_step,
                    "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}  # fmt: skip
        mt.remove()
    return out


def test_ddp_two_processes_masks_exact_after_100_steps(tmp_path):
    r0, r1 = run_ddp(_ddp_worker, tmp_path, weights_only=False)
    for run in DDP_RUNS:
        for r in (r0, r1):
            assert r[run]["off_mask_nonzeros"] == 0 and r[run]["grads_ok"] and not r[run]["remask_every_step"], run
        for k, v in r0[run]["state"].items():
            assert torch.equal(v, r1[run]["state"][k]), (run, k)
        model = _model()
        model.load_state_dict(r0[run]["state"])
        for m in _pruned(model).values():
            assert sparsity.is_2_4(m.weight)
        if run == "sgd_momentum_wd":  # equal to one process on the global batches, gradients masked by hand
            ref = _model()
            opt = OPTIMIZERS[run](ref.parameters())
            for (x0, y0), (x1, y1) in zip(_batches(STEPS, seed=10), _batches(STEPS, seed=11)):
                opt.zero_grad()
                F.cross_entropy(ref(torch.cat([x0, x1])), torch.cat([y0, y1])).backward()
                with torch.no_grad():
                    for m in _pruned(ref).values():
                        m.weight.grad.mul_(sparsity.get_mask(m))
                opt.step()
            for k, v in ref.state_dict().items():
                torch.testing.assert_close(r0[run]["state"][k], v, rtol=1e-4, atol=1e-5, msg=k)


def test_weight_replaced_after_start_is_hooked_after_the_next_step():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mt = sparsity.MaskedTraining(model, opt, check_every=0)
    old = model[0].weight
    new = nn.Parameter(old.detach().clone())  # e.g. load_state_dict(assign=True), or a wrapper that swaps parameters
    model[0].weight = new
    opt.param_groups[0]["params"][0] = new
    opt.state.pop(old, None)
    for i, (x, y) in enumerate(_batches(6)):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if i > 0:  # hooked after the first step: its gradient is masked from then on
            assert int(torch.count_nonzero(new.grad[~sparsity.get_mask(model[0])])) == 0
        opt.step()
        assert _off_mask_nonzeros(model) == 0  # the first step's move at the pruned positions is undone
    mt.remove()
