"""Research (2026-12-03, not adopted): block-wise AutoRound-style tuning of
SmolLM2-135M at int4, group 128, asymmetric (docs/quantization.md, "Block-wise
tuning in the style of AutoRound").

    python -m benchmarks.blockwise_tuning_research --name NAME --init {rtn,gptq}
        --iters N --bs 4 --samples 32 --crop 256 --loss rel [--output DIR]

init=rtn: AutoRound's parameterisation from round to nearest on a min/max grid:
    s = (max(w,0)*alpha - min(w,0)*beta)/15, zp = round(-min*beta/s) (integer),
    q = clamp(round(w/s + V) + zp, 0, 15), V in [-0.5,0.5] init 0,
    alpha, beta in [0.5,1] init 1.
init=gptq: the library's GPTQ (refined grid + refit, damping 0.01,
    sink-weighted q/k/v Hessians, inputs from the quantized chain), then
    (optionally) the scale (s0*(1+a)) and a real zero (z0+b) tuned with the
    codes fixed, and V in [-0.5,0.5] around GPTQ's codes.
Loss: MSE(qblock(x_q), target) where target = float block on the float-chain input (AutoRound's
default, --target float) or the float block on the quantized-chain input (--target q).
signSGD, lr linearly decayed to 0, best (lowest minibatch loss) parameters kept (as AutoRound).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dtype_policies.bench.realmodels import models, quality, text
from dtype_policies.quantization.calibration import SINK_ROW_WEIGHT
from dtype_policies.quantizers.calibration_data import token_windows
from dtype_policies.quantizers.gptq import gptq_quantize

GS = 128
MAXQ = 15.0
NAMES = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]
SEQ_GROUPS = [NAMES[0:3], NAMES[3:4], NAMES[4:6], NAMES[6:7]]


def round_ste(x):
    return (x.round() - x).detach() + x


def get(module, path):
    for p in path.split("."):
        module = getattr(module, p)
    return module


def set_(module, path, value):
    parts = path.split(".")
    for p in parts[:-1]:
        module = getattr(module, p)
    setattr(module, parts[-1], value)


def grouped(w):
    """(N, K) -> (N, G, GS) zero-padded."""
    n, k = w.shape
    g = -(-k // GS)
    if g * GS != k:
        w = F.pad(w, (0, g * GS - k))
    return w.reshape(n, g, GS)


class QLinear(torch.nn.Module):
    def __init__(self, weight, mode, gptq=None, tune_v=True, tune_sz=True):
        super().__init__()
        self.mode, self.k = mode, weight.shape[1]
        w = weight.detach().float()
        self.register_buffer("wg", grouped(w))
        n, g, _ = self.wg.shape
        self.params = []
        if mode == "rtn":
            self.register_buffer("wmin", self.wg.amin(-1).clamp(max=0))
            self.register_buffer("wmax", self.wg.amax(-1).clamp(min=0))
            self.v = torch.nn.Parameter(torch.zeros(n, g, GS))
            self.alpha = torch.nn.Parameter(torch.ones(n, g))
            self.beta = torch.nn.Parameter(torch.ones(n, g))
            self.params = [(self.v, -0.5, 0.5), (self.alpha, 0.5, 1.0), (self.beta, 0.5, 1.0)]
            if not tune_v:
                self.params = self.params[1:]
        else:  # gptq codes q0 (N, K), scale, zero (N, G)
            q0, s0, z0 = gptq
            self.register_buffer("q0", grouped(q0.float()))
            self.register_buffer("s0", s0.float())
            self.register_buffer("z0", z0.float())
            x = self.wg / s0[..., None] + z0[..., None]
            self.register_buffer("e", (x - self.q0).clamp(-0.499, 0.499))
            self.v = torch.nn.Parameter(torch.zeros(n, g, GS))
            self.a = torch.nn.Parameter(torch.zeros(n, g))
            self.b = torch.nn.Parameter(torch.zeros(n, g))
            if tune_v:
                self.params.append((self.v, -0.5, 0.5))
            if tune_sz:
                self.params += [(self.a, -0.3, 0.3), (self.b, -1.0, 1.0)]

    def qparams(self):
        """(codes (N,G,GS), scale (N,G), zero (N,G))"""
        if self.mode == "rtn":
            hi, lo = self.wmax * self.alpha, self.wmin * self.beta
            s = ((hi - lo) / MAXQ).clamp(min=1e-6)
            zp = round_ste(-lo / s)
            q = torch.clamp(round_ste(self.wg / s[..., None] + self.v) + zp[..., None], 0, MAXQ)
            return q, s, zp
        s = self.s0 * (1 + self.a)
        z = self.z0 + self.b
        q = torch.clamp(self.q0 + round_ste(self.e + self.v), 0, MAXQ)
        return q, s, z

    def qweight(self):
        q, s, z = self.qparams()
        w = (q - z[..., None]) * s[..., None]
        return w.reshape(w.shape[0], -1)[:, : self.k]

    def forward(self, x):
        return F.linear(x, self.qweight())


def block_call(layer, h, pe, pid):
    out = layer(h, attention_mask=None, position_embeddings=pe, position_ids=pid)
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def run_all(layer, xs, pe, pid, bs=8):
    return torch.cat([block_call(layer, xs[i : i + bs], pe, pid) for i in range(0, len(xs), bs)])


@torch.no_grad()
def gptq_block(layer, xq, pe, pid, damping, bs=8, sequential=False):
    """True-sequential GPTQ of the block's linears in place (weights set to the dequantized
    result); returns {name: (q, scale, zero)}."""
    result = {}
    for group in SEQ_GROUPS if sequential else [NAMES]:
        stats = {n: [None, 0.0, 0] for n in group}
        hooks = []
        for name in group:
            mod = get(layer, name)

            def hook(m, args, name=name, stats=stats):
                x = args[0].detach().float()
                b, t, k = x.shape
                wts = torch.ones(b, t)
                if name in NAMES[0:3]:
                    wts[:, 0] = SINK_ROW_WEIGHT
                rows = x.reshape(-1, k)
                wr = wts.reshape(-1, 1)
                h = (rows * wr).t() @ rows
                st = stats[name]
                st[0] = h if st[0] is None else st[0] + h
                st[1] += float(wr.sum())
                st[2] += rows.shape[0]

            hooks.append(mod.register_forward_pre_hook(hook))
        for i in range(0, len(xq), bs):
            block_call(layer, xq[i : i + bs], pe, pid)
        for h in hooks:
            h.remove()
        for name in group:
            mod = get(layer, name)
            hsum, wsum, rows = stats[name]
            hess = 2 * hsum / wsum
            q, s, z, g_idx = gptq_quantize(
                mod.weight.detach().float(),
                hess,
                bits=4,
                group_size=GS,
                damping=damping,
                samples=rows,
            )
            w = (q.float() - z[:, g_idx]) * s[:, g_idx]
            mod.weight.data.copy_(w)
            result[name] = (q, s, z)
    return result


def tune(
    qblock, qlins, xq, target, pe, pid, iters, bs, lr, skip0, seed, rel, crop=None, sz_mult=1.0
):
    params = [p for ql in qlins for p in ql.params]
    mults = {id(ql.v): 1.0 for ql in qlins}
    if crop:
        pe = (pe[0][:, :crop], pe[1][:, :crop])
        pid = pid[:, :crop]
    if iters == 0 or not params:
        return {}
    gen = torch.Generator().manual_seed(seed)
    best, best_loss, first_loss, losses = None, float("inf"), None, []
    for it in range(iters):
        idx = torch.randperm(len(xq), generator=gen)[:bs]
        out = block_call(qblock, xq[idx][:, :crop], pe, pid)
        tgt = target[idx][:, :crop]
        if skip0:
            out, tgt = out[:, 1:], tgt[:, 1:]
        if rel:  # each token's squared error relative to its target's mean square
            loss = (((out - tgt) ** 2).mean(-1) / (tgt**2).mean(-1).clamp(min=1e-8)).mean()
        else:
            loss = F.mse_loss(out, tgt)
        for p, _, _ in params:
            p.grad = None
        loss.backward()
        lv = loss.item()
        losses.append(lv)
        if first_loss is None:
            first_loss = lv
        if lv < best_loss:
            best_loss = lv
            best = [p.detach().clone() for p, _, _ in params]
        step = lr * (1 - it / iters)
        with torch.no_grad():
            for p, lo, hi in params:
                if p.grad is not None:
                    p.sub_(step * mults.get(id(p), sz_mult) * p.grad.sign()).clamp_(lo, hi)
    with torch.no_grad():
        for (p, _, _), b in zip(params, best):
            p.copy_(b)
    return {"first_loss": first_loss, "best_loss": best_loss, "last10": sum(losses[-10:]) / 10}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--init", choices=["rtn", "gptq"], default="rtn")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--lr", type=float, default=None, help="default 1/iters")
    ap.add_argument("--no-v", action="store_true")
    ap.add_argument("--no-sz", action="store_true")
    ap.add_argument("--target", choices=["float", "q"], default="float")
    ap.add_argument("--skip0", action="store_true", help="exclude position 0 from the loss")
    ap.add_argument("--loss", choices=["mse", "rel"], default="mse")
    ap.add_argument("--crop", type=int, default=None, help="tune on the first CROP positions")
    ap.add_argument(
        "--sz-lr-mult", type=float, default=1.0, help="lr multiplier of scale/zero/clip params"
    )
    ap.add_argument("--sequential", action="store_true", help="true-sequential GPTQ in the block")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--damping", type=float, default=0.01)
    ap.add_argument("--blocks", type=int, default=None, help="only the first N blocks (timing)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default="/tmp/blockwise_tuning", help="logs, results, codes")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lr = args.lr if args.lr is not None else 1.0 / max(args.iters, 1)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    log = (output / f"{args.name}.log").open("a")  # open for the whole run

    def say(*a):
        s = " ".join(str(x) for x in a)
        print(s, flush=True)
        log.write(s + "\n")
        log.flush()

    say("ARGS", vars(args))
    model, _ = models.load_smollm2()
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    ids = torch.tensor(
        quality.lm_tokenizer()(text.lm_calibration_text(), add_special_tokens=False)["input_ids"]
    )
    windows = token_windows([ids], None, args.samples, 512)
    with torch.no_grad():
        x0 = model.model.embed_tokens(windows).float()
    pid = torch.arange(512)[None]
    pe = model.model.rotary_emb(x0[:1], position_ids=pid)
    xf, xq = x0, x0.clone()
    layers = model.model.layers
    nblocks = len(layers) if args.blocks is None else args.blocks
    final = {}
    codes = {}
    init_w = {}
    t_start = time.time()
    t_tune_total = 0.0
    for i in range(nblocks):
        tb = time.time()
        layer = layers[i]
        yf = run_all(layer, xf if args.target == "float" else xq, pe, pid)
        qblock = copy.deepcopy(layer)
        gq = None
        if args.init == "gptq":
            gq = gptq_block(qblock, xq, pe, pid, args.damping, sequential=args.sequential)
            for name in NAMES:
                init_w[f"model.layers.{i}.{name}.weight"] = (
                    get(qblock, name).weight.detach().clone()
                )
        t_init = time.time() - tb
        qlins = []
        for name in NAMES:
            lin = get(layer, name)
            ql = QLinear(
                lin.weight,
                args.init,
                gptq=None if gq is None else gq[name],
                tune_v=not args.no_v,
                tune_sz=not args.no_sz,
            )
            set_(qblock, name, ql)
            qlins.append(ql)
        with torch.no_grad():
            before = F.mse_loss(run_all(qblock, xq[:4], pe, pid), yf[:4]).item()
        tt = time.time()
        info = tune(
            qblock,
            qlins,
            xq,
            yf,
            pe,
            pid,
            args.iters,
            args.bs,
            lr,
            args.skip0,
            args.seed + i,
            args.loss == "rel",
            args.crop,
            args.sz_lr_mult,
        )
        t_tune = time.time() - tt
        t_tune_total += t_tune
        with torch.no_grad():
            for name, ql in zip(NAMES, qlins):
                w = ql.qweight().detach().clone()
                q, s, z = ql.qparams()
                final[f"model.layers.{i}.{name}.weight"] = w
                codes[f"model.layers.{i}.{name}"] = (
                    q.detach().to(torch.uint8),
                    s.detach().clone(),
                    z.detach().clone(),
                )
                set_(qblock, name, torch.nn.Linear(w.shape[1], w.shape[0], bias=False))
                get(qblock, name).weight.data.copy_(w)
            after = F.mse_loss(run_all(qblock, xq[:4], pe, pid), yf[:4]).item()
            xq_next = run_all(qblock, xq, pe, pid)
            xf = yf if args.target == "float" else None
            xq = xq_next
        say(
            f"block {i}: mse(first4) {before:.5g} -> {after:.5g} {info} init {t_init:.1f}s "
            f"tune {t_tune:.1f}s ({t_tune / max(args.iters, 1):.3f}s/it) "
            f"block {time.time() - tb:.1f}s"
        )
        if args.target == "q":
            xf = xq  # float target on the quantized chain's input
    total = time.time() - t_start
    say(f"total pipeline {total:.0f}s, tuning {t_tune_total:.0f}s")
    if args.blocks is not None:
        return
    nonint = 0
    total_groups = 0
    for _q, _s, z in codes.values():
        nonint += int((z - z.round()).abs().gt(1e-6).sum())
        total_groups += z.numel()
    sd = model.state_dict()
    if init_w and args.iters > 0:  # the GPTQ init (same chain inputs) for a paired comparison
        with torch.no_grad():
            for k, w in init_w.items():
                sd[k].copy_(w)
        r0 = quality.evaluate_lm(model)
        say("GPTQ-INIT RESULT", json.dumps(r0))
    with torch.no_grad():
        for k, w in final.items():
            sd[k].copy_(w)
    te = time.time()
    res = quality.evaluate_lm(model)
    res.update(
        loss=args.loss,
        name=args.name,
        init=args.init,
        iters=args.iters,
        bs=args.bs,
        samples=args.samples,
        lr=lr,
        target=args.target,
        skip0=args.skip0,
        tune_v=not args.no_v,
        tune_sz=not args.no_sz,
        pipeline_s=total,
        tuning_s=t_tune_total,
        nonint_zero_groups=nonint,
        groups=total_groups,
    )
    say("RESULT", json.dumps(res), f"eval {time.time() - te:.0f}s")
    (output / f"{args.name}.json").write_text(json.dumps(res))
    torch.save(codes, output / f"{args.name}_codes.pt")


if __name__ == "__main__":
    main()
