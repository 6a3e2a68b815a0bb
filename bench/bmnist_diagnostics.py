"""Why does (or doesn't) Bouncing MNIST learn? Four checks, each on simulated videos whose
true digit positions are known (issue 18: gradients and objectives on small data first).

    python bench/bmnist_diagnostics.py peak                    # no learning at all
    python bench/bmnist_diagnostics.py identity --digits 3 --frames 10
    python bench/bmnist_diagnostics.py decoder --iterations 300
    python bench/bmnist_diagnostics.py apg --videos 1 --iterations 300
    python bench/bmnist_diagnostics.py modes --init <cell>/model.pt --data data/bmnist/test_T10_D3.npz

- ``peak``: the signal the position proposals start from. Each frame is correlated with
  the mean-digit template and digits are placed greedily at the map's argmax, explaining
  away each placed digit as the encoder does; the position error of that rule against the
  truth is what a where network reading the softmaxed map can reach without a decoder.
- ``identity``: can a digit's own template tell it from the others? With the video's true
  MNIST digits as templates (the best a decoder can do) and the digits before it explained
  away at their true positions (the where kernel's order), where does each digit's map peak:
  within 3 px of its own digit, of another digit, or of neither? For the kernel's map (the
  frame's correlation with the template) and for the Bernoulli log-likelihood ratio of the
  template placed at each offset (the frame's evidence for it there, up to a constant).
- ``decoder``: can the decoder learn digits when positions are given? The true positions
  are fixed, z_what is proposed by the what network from crops, and decoder and what network
  are trained on the ELBO (reparameterized); prints the reconstruction MSE per pixel.
- ``apg``: APG training (the pipeline's Trainer) on ``--videos`` videos, printing the
  position error of the highest-weight particle on those same videos, the training log
  joint and the gradient norm of each network every ``--every`` steps: can it overfit?
  With ``--heldout``, the position error is measured on fresh videos instead
  (``--eval-frames`` long, at ``--eval-sweeps`` and ``--eval-particles``); with ``--init``,
  training starts from a trained cell's networks (a pipeline ``model.pt``: a curriculum's
  next step, e.g. a one-digit cell trained on ``--digits 3``). Besides the position error
  (one matching of digits per video) it prints the error with each frame matched alone and
  the frames whose boxes traded digits (``apg.tasks.bmnist.position_errors``). With
  ``--save``, a long run checkpoints at every print and resumes from there when started
  again with the same arguments (the videos are drawn again from ``--seed``; a 2+2-step
  resume logged the log joint of an unbroken 4-step run).
- ``modes``: when boxes trade digits, does the model prefer the trade, or is the sampler
  stuck in it? A trained cell's APG (``--eval-sweeps``, ``--eval-particles``) runs on a
  held-out set (``--data``, a pipeline test set with the true positions); its
  highest-weight particle's boxes are relabelled frame by frame so that each keeps the
  digit it follows in most of the video ("untraded"). For the sampler's boxes, the
  untraded ones and the true boxes, z_what is fitted to the largest log p(x, z) (Adam from
  the what network's mean, ``--iterations`` steps at ``--lr``); per video, the log joints
  say which configuration the model prefers.

Prints one line per checkpoint; nothing is written. MNIST from $APG_MNIST_DIR.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from apg.checkpoint import load_checkpoint, save_checkpoint
from apg.metrics import highest_weight_particle
from apg.tasks import bmnist
from apg.training import TrainConfig, Trainer, make_method


def videos(count: int, frames: int, digits: int, seed: int) -> dict[str, torch.Tensor]:
    model = bmnist.build_model()
    return bmnist.simulate(model, count, torch.Generator().manual_seed(seed), frames, digits, "train")


def peak(args) -> None:
    data = videos(args.videos, args.frames, args.digits, args.seed)
    x, truth = data["x"], data["z_where"]
    tmpl = bmnist.proposals._mean_digit_blob()
    size = tmpl.shape[-1]
    auto = F.conv2d(F.pad(tmpl, (size - 1,) * 4)[None, None], tmpl[None, None])[0, 0]
    corr = F.conv2d(x.reshape(-1, 1, 96, 96), tmpl[None, None])[:, 0]  # (M T, 69, 69)
    side = corr.shape[-1]
    placed = []
    for _ in range(args.digits):
        flat = corr.flatten(1).argmax(1)
        offset = torch.stack([flat % side, flat // side], -1).to(corr.dtype)  # (column, row)
        placed.append(offset / (0.5 * (96 - 28)) - 1.0)
        shift = offset - (size - 1)
        corr = (
            corr - bmnist.render(auto.expand(len(corr), 1, 1, *auto.shape), shift[:, None, None], side)[:, 0]
        )
    where = torch.stack(placed, 1).reshape(args.videos, args.frames, args.digits, 2)
    err = bmnist.position_errors(truth, where)
    print(
        f"peak: {args.videos} videos T={args.frames} D={args.digits}: position error "
        f"{err['pos_err'].mean():.2f} px (median {float(torch.tensor(err['pos_err']).median()):.2f}), "
        f"tracked frames {err['tracked'].mean():.3f}; each frame matched alone (the rule places "
        f"each frame on its own) {err['pos_err_frame'].mean():.2f} px, tracked {err['tracked_frame'].mean():.3f}"
    )


def identity(args) -> None:
    from apg.data.mnist import load_mnist

    data = videos(args.videos, args.frames, args.digits, args.seed)
    cfg = bmnist.BMNISTConfig()
    eps = cfg.prob_eps
    x, indices = data["x"].double(), data["indices"]
    offset = bmnist.pixel_offsets(data["z_where"].double(), cfg.canvas_size, cfg.digit_size)  # (column, row)
    digits = torch.from_numpy(load_mnist("train").images).double()[indices] / 255.0  # (M, D, S, S)
    p = digits.clamp(eps, 1 - eps)
    maps = {
        "correlation": digits,
        "log-likelihood ratio": torch.log(p / eps) - torch.log((1 - p) / (1 - eps)),
    }
    counts = {name: torch.zeros(3) for name in maps}  # own digit, another digit, neither
    for m in range(args.videos):
        for t in range(args.frames):
            frame = x[m, t]
            for d in range(args.digits):
                for name, kernels in maps.items():
                    corr = F.conv2d(frame[None, None], kernels[m, d][None, None])[0, 0]
                    row, column = divmod(int(corr.argmax()), corr.shape[1])
                    dist = (offset[m, t] - torch.tensor([column, row], dtype=torch.float64)).norm(dim=-1)
                    near = dist <= bmnist.TRACK_TOLERANCE_PX
                    counts[name][0 if near[d] else 1 if near.any() else 2] += 1
                # explain digit d away where it truly is, before the next digit's map
                frame = (
                    frame
                    - bmnist.render(digits[m, d][None, None], offset[m, t, d][None, None], cfg.canvas_size)[
                        0, 0
                    ]
                )
    for name, c in counts.items():
        own, other, neither = (c / c.sum()).tolist()
        print(
            f"identity: {args.videos} videos T={args.frames} D={args.digits}, {name} map: peak at its own digit "
            f"{own:.3f}, at another digit {other:.3f}, at neither {neither:.3f}"
        )


def decoder(args) -> None:
    torch.manual_seed(args.seed)
    data = videos(args.videos, args.frames, args.digits, args.seed)
    x, truth = data["x"], data["z_where"]
    model = bmnist.build_model()
    proposals = bmnist.build_proposals(model, "apg", args.digits)
    params = [*model.parameters(), *proposals.what_net.parameters()]
    opt = torch.optim.Adam(params, lr=args.lr, betas=(0.9, 0.99))
    start = time.perf_counter()
    for it in range(1, args.iterations + 1):
        idx = torch.randperm(len(x))[: args.batch]
        xb, wb = x[idx], truth[idx][None]  # where (1, B, T, D, 2)
        q = proposals._what(xb, wb)
        z_what = q.rsample()
        z = {"z_what": z_what, **{bmnist.where_key(t + 1): wb[:, :, t] for t in range(args.frames)}}
        elbo = model.log_joint(xb, z) - q.log_prob(z_what).sum((-2, -1))
        loss = -elbo.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if it % args.every == 0 or it == 1:
            with torch.no_grad():
                mse = ((model.reconstruct({**z, "z_what": q.loc}, args.frames)[0] - xb) ** 2).mean()
            print(
                f"decoder it {it}: ELBO/frame {-loss.item() / args.frames:.1f}, reconstruction MSE {mse:.4f}, "
                f"{time.perf_counter() - start:.0f} s",
                flush=True,
            )


def apg(args) -> None:
    torch.manual_seed(args.seed)
    data = videos(args.videos, args.frames, args.digits, args.seed)
    x, truth, centres = data["x"], data["z_where"], data["centres"]
    cfg = TrainConfig(
        task="bmnist",
        method=args.method,
        sweeps=args.sweeps,
        particles=args.particles,
        batch_size=min(args.batch, args.videos),
        iterations=args.iterations,
        lr=args.lr,
        network={
            "num_digits": args.digits,
            "share_where_net": args.share_where_net,
            "read_coordinates": not args.random_where_init,
        },
    )
    trainer = Trainer(cfg, x)
    if args.save and Path(args.save).is_file():  # a stopped run goes on where it was saved
        _, state = load_checkpoint(args.save)
        trainer.load_state_dict(state)
        print(f"apg: resumed from {args.save} at step {trainer.iteration}", flush=True)
    elif args.init:
        _, state = load_checkpoint(args.init)
        trainer.model.load_state_dict(state["model"])
        trainer.proposals.load_state_dict(state["proposals"])
    nets = {
        "where": trainer.proposals.where_net,
        "what": trainer.proposals.what_net,
        "decoder": trainer.model.decoder,
    }
    if args.heldout:  # fresh videos of MNIST's test digits: does it generalize?
        held = bmnist.simulate(
            trainer.model,
            args.eval_videos,
            torch.Generator().manual_seed(args.seed + 1),
            args.eval_frames or args.frames,
            args.digits,
            "test",
        )
        x, truth, centres = held["x"], held["z_where"], held["centres"]
    start = time.perf_counter()
    eval_cfg = TrainConfig.from_dict(
        {
            **cfg.to_dict(),
            "sweeps": args.eval_sweeps or cfg.sweeps,
            "particles": args.eval_particles or cfg.particles,
        }
    )
    for out in trainer.run():
        it = trainer.iteration
        if it % args.every and it != 1:
            continue
        grads = {
            name: sum(float(p.grad.norm()) ** 2 for p in net.parameters() if p.grad is not None) ** 0.5
            for name, net in nets.items()
        }
        sweeps = evaluate_sweeps(
            trainer, eval_cfg, x[: args.eval_videos], truth[: args.eval_videos], centres[: args.eval_videos]
        )
        print(
            f"{args.method} it {it}: log joint {out['log_joint']:.1f}, ESS/L {out['ess']:.2f}; held-out by sweep: "
            + ", ".join(
                f"{k}: {lj:.0f} / {e:.2f} ± {se:.2f} px ({b:.2f} box, {tr:.2f} tracked; {ef:.2f} px per frame, "
                f"{sw:.2f} traded)"
                for k, (lj, e, se, b, tr, ef, sw) in sweeps.items()
            )
            + "; |grad| "
            + " ".join(f"{k} {v:.3g}" for k, v in grads.items())
            + f", {time.perf_counter() - start:.0f} s",
            flush=True,
        )
        if args.save:  # weights, optimizer and data order, written whole or not at all
            save_checkpoint(args.save, cfg.to_dict(), trainer.state_dict())


def evaluate_sweeps(trainer, cfg, x, truth, centres) -> dict[int, tuple[float, ...]]:
    """``{sweep: (mean log joint, position error, its standard error over videos, box error,
    tracked frames, error with each frame matched alone, frames with traded digits)}`` of the
    highest-weight particle after each sweep."""
    model = trainer.model
    found: dict[int, tuple[float, ...]] = {}

    def collect(k, z, log_w):
        chosen = highest_weight_particle(z, log_w)
        where = bmnist.stack_where({n: v[None] for n, v in chosen.items()}, x.shape[1])[0]
        found_centres = bmnist.ink_centres(model.templates(chosen["z_what"][None])[0])
        err = bmnist.position_errors(truth, where, true_centres=centres, centres=found_centres)
        log_joint = model.log_joint(x, {n: v[None] for n, v in chosen.items()}).mean()
        pos_err = torch.as_tensor(err["pos_err"])
        found[k] = (
            float(log_joint),
            float(pos_err.mean()),
            float(pos_err.std() / len(pos_err) ** 0.5),
            *(float(err[name].mean()) for name in ("box_err", "tracked", "pos_err_frame", "swapped")),
        )

    with torch.no_grad():
        make_method(cfg).run(
            model,
            trainer.proposals,
            x,
            cfg.sweeps,
            cfg.particles,
            "block",
            "systematic",
            collectors=[collect],
        )
    return found


def modes(args) -> None:
    import itertools

    import numpy as np

    from apg.training import build

    data = np.load(args.data)
    count = args.eval_videos
    x = torch.as_tensor(data["x"][:count]).float()
    truth = torch.as_tensor(data["z_where"][:count]).float()  # (M, T, D, 2)
    true_centres = torch.as_tensor(data["centres"][:count]).float()
    num_frames, digits = truth.shape[1:3]
    cfg = TrainConfig(
        task="bmnist",
        method="apg",
        sweeps=args.eval_sweeps or 5,
        particles=args.eval_particles or 10,
        network={"num_digits": digits},
        batch_size=20,
        iterations=1000,
        lr=1e-4,
    )
    model, proposals = build(cfg)
    _, state = load_checkpoint(args.init)
    model.load_state_dict(state["model"])
    proposals.load_state_dict(state["proposals"])
    for p in (*model.parameters(), *proposals.parameters()):
        p.requires_grad_(False)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        result = make_method(cfg).run(model, proposals, x, cfg.sweeps, cfg.particles, "block", "systematic")
    chosen = highest_weight_particle(result.z, result.log_weights)
    where = bmnist.stack_where({n: v[None] for n, v in chosen.items()}, num_frames)[0]  # (M, T, D, 2)
    z_what = chosen["z_what"]  # (M, D, Z)
    centres = bmnist.ink_centres(model.templates(z_what[None])[0])
    errors = bmnist.position_errors(truth, where, true_centres=true_centres, centres=centres)

    # Relabel: the identity of slot i is the true digit it follows over the video (one
    # permutation, as pos_err); at frame t it takes the box that frame's own matching
    # puts on that digit.
    cfg_m = model.cfg
    px, mid = 0.5 * (cfg_m.canvas_size - cfg_m.digit_size), 0.5 * (cfg_m.digit_size - 1)
    ink = where + ((centres - mid) / px)[:, None]
    true_ink = truth + ((true_centres - mid) / px)[:, None]
    dist = torch.linalg.vector_norm(ink.unsqueeze(3) - true_ink.unsqueeze(2), dim=-1)  # (M, T, i, j)
    perms = torch.tensor(list(itertools.permutations(range(digits))))
    matched = dist[:, :, torch.arange(digits)[None], perms]  # (M, T, P, D): box i on digit perms[p, i]
    video_perm = perms[matched.mean((1, 3)).argmin(-1)]  # (M, D): slot i follows digit video_perm[i]
    frame_perm = perms[matched.mean(3).argmin(2)]  # (M, T, D): at frame t box k is on frame_perm[k]
    box_on = frame_perm.argsort(-1)  # (M, T, D): the box on digit j at frame t
    take = box_on.gather(2, video_perm[:, None].expand(-1, num_frames, -1))  # (M, T, D)
    untraded = where.gather(2, take[..., None].expand(-1, -1, -1, 2))

    def positions(w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Boxes ``(M, T, D, 2)`` as the model's latents, one particle."""
        return {bmnist.where_key(t + 1): w[None, :, t] for t in range(num_frames)}

    def fitted(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per video: log p(x, z) at the what network's mean and at the fitted z_what."""
        latents = positions(w)
        start = proposals._what(x, w[None]).loc.detach()
        z = start.clone().requires_grad_()
        opt = torch.optim.Adam([z], lr=args.lr)
        for _ in range(args.iterations):
            opt.zero_grad()
            (-model.log_joint(x, {**latents, "z_what": z}).sum()).backward()
            opt.step()
        with torch.no_grad():
            return (
                model.log_joint(x, {**latents, "z_what": start})[0],
                model.log_joint(x, {**latents, "z_what": z})[0],
            )

    with torch.no_grad():
        own = model.log_joint(x, {**positions(where), "z_what": z_what[None]})[0]
    configs = {"sampler's": fitted(where), "untraded": fitted(untraded), "true boxes": fitted(truth)}
    traded = torch.as_tensor(errors["pos_err"] - errors["pos_err_frame"]) > 1.0
    print(
        f"modes: {count} videos T={num_frames} D={digits}, APG K={cfg.sweeps} L={cfg.particles}, "
        f"z_what fitted by {args.iterations} Adam steps at lr {args.lr}; {int(traded.sum())} videos trade digits "
        "(error per video - per frame > 1 px)"
    )
    print(
        "video | px per video / per frame | log p(x,z): sampler's own | "
        + " | ".join(f"{k} (q mean, fitted)" for k in configs)
    )
    for m in range(count):
        print(
            f"{m} | {errors['pos_err'][m]:.2f} / {errors['pos_err_frame'][m]:.2f}{' traded' if traded[m] else ''} | "
            f"{own[m]:.1f} | " + " | ".join(f"{a[m]:.1f}, {b[m]:.1f}" for a, b in configs.values())
        )
    for name, group in (("trading", traded), ("not trading", ~traded)):
        if not group.any():
            continue
        gain = (configs["untraded"][1] - configs["sampler's"][1])[group]
        truth_gain = (configs["true boxes"][1] - configs["sampler's"][1])[group]
        print(
            f"{name} videos ({int(group.sum())}): fitted log joint, untraded - sampler's: mean {gain.mean():.1f} "
            f"(higher in {int((gain > 0).sum())}); true boxes - sampler's: mean {truth_gain.mean():.1f} "
            f"(higher in {int((truth_gain > 0).sum())})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("check", choices=["peak", "identity", "decoder", "apg", "modes"])
    parser.add_argument("--videos", type=int, default=100)
    parser.add_argument("--eval-videos", type=int, default=20)
    parser.add_argument("--frames", type=int, default=5)
    parser.add_argument("--digits", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--batch", type=int, default=5)
    parser.add_argument("--sweeps", type=int, default=3)
    parser.add_argument("--particles", type=int, default=4)
    parser.add_argument("--method", default="apg")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--heldout", action="store_true", help="apg: score held-out videos, not the training ones"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--random-where-init",
        action="store_true",
        help="apg: where networks from random weights, not a soft-argmax",
    )
    parser.add_argument(
        "--share-where-net", action="store_true", help="apg: one where network for encoder and kernels"
    )
    parser.add_argument("--data", help="modes: a pipeline test set (.npz with x, z_where, centres)")
    parser.add_argument("--init", help="apg: start from this trained cell's networks (a pipeline model.pt)")
    parser.add_argument(
        "--save",
        help="apg: the run's checkpoint, written at every print; if it exists, the run resumes from it",
    )
    parser.add_argument(
        "--eval-frames", type=int, help="apg --heldout: frames per held-out video (default --frames)"
    )
    parser.add_argument("--eval-sweeps", type=int, help="apg: K of the held-out runs (default --sweeps)")
    parser.add_argument(
        "--eval-particles", type=int, help="apg: L of the held-out runs (default --particles)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    {"peak": peak, "identity": identity, "decoder": decoder, "apg": apg, "modes": modes}[args.check](args)


if __name__ == "__main__":
    main()
