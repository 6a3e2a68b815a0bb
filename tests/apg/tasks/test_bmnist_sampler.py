"""Bouncing MNIST's simulator, sampler and proposals end to end, the tracking metrics, and a
short training run (slow)."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch

from apg.smc.sampler import run_apg
from apg.tasks import bmnist, get_task
from apg.tasks.bmnist import (
    BouncingMNIST,
    pixel_offsets,
    reflect,
    render,
    simulate_trajectories,
)
from tests.apg.tasks.bmnist_support import random_latents
from tests.montecarlo import mean_se
from tests.support import MNIST_DIR, needs_mnist

# --------------------------------------------------------------------------- simulator


def test_reflect_folds_into_the_box():
    u = torch.tensor([0.0, 0.5, 1.2, -1.2, 3.0, -5.5, 7.9])
    assert torch.allclose(reflect(u), torch.tensor([0.0, 0.5, 0.8, -0.8, -1.0, -0.5, -0.1]), atol=1e-6)


def test_trajectories_stay_inside_and_follow_the_random_walk():
    g = torch.Generator().manual_seed(1)
    where = simulate_trajectories(400, 30, 3, 0.2, g)
    assert where.shape == (400, 30, 3, 2)
    assert where.abs().max() <= 1.0
    steps = where[:, 1:] - where[:, :-1]
    # away from the walls a step is the model's Normal(0, 0.2^2) increment
    interior = (where[:, :-1].abs() < 0.4).all(-1, keepdim=True).expand_as(steps)
    sd = steps[interior].std().item()
    assert abs(sd - 0.2) < 4 * 0.2 / math.sqrt(2 * int(interior.sum()))  # 4 standard errors of an sd


@needs_mnist
def test_simulated_videos_keep_digits_inside_the_canvas():
    task = get_task("bmnist")
    model = task.build_model()
    g = torch.Generator().manual_seed(0)
    data = task.simulate(model, 6, g, num_frames=7, num_digits=3, split="test", mnist_dir=str(MNIST_DIR))
    x, where = data["x"], data["z_where"]
    assert x.shape == (6, 7, 96, 96) and where.shape == (6, 7, 3, 2)
    assert data["labels"].shape == (6, 3) and x.min() >= 0 and x.max() <= 1
    assert where.abs().max() <= 1
    # MNIST centres each digit's ink in its box (to a pixel or so)
    assert data["centres"].shape == (6, 3, 2) and ((data["centres"] - 13.5).abs() < 1.5).all()
    # every digit lies wholly inside its 29 x 29 box and every box inside the canvas: all
    # ink of each digit shows, and there is no ink outside the boxes
    from apg.data.mnist import load_mnist

    images = torch.from_numpy(load_mnist("test", str(MNIST_DIR)).images).float() / 255
    off = pixel_offsets(where)
    assert off.min() >= 0 and off.max() <= 68
    for m in range(6):
        for t in range(7):
            for d in range(3):
                alone = render(images[data["indices"][m, d]][None], off[m, t, d][None])
                assert torch.allclose(alone.sum(), images[data["indices"][m, d]].sum(), rtol=1e-5)
    mask = torch.zeros_like(x, dtype=torch.bool)
    base = torch.floor(off).long()
    for m in range(6):
        for t in range(7):
            for d in range(3):
                c, r = base[m, t, d].tolist()
                mask[m, t, r : r + 29, c : c + 29] = True
    assert x[~mask].abs().max() == 0
    # training videos come from the training split
    train = task.simulate(model, 2, g, num_frames=2, num_digits=2, split="train", mnist_dir=str(MNIST_DIR))
    assert train["indices"].max() < 60000 and train["x"].shape == (2, 2, 96, 96)


# --------------------------------------------------------------------------- proposals and sampler


def test_apg_run_shapes_and_gradients():
    task = get_task("bmnist")
    model = task.build_model()
    prop = task.build_proposals(model, "apg", num_digits=2)
    x = torch.rand(2, 3, 96, 96) * (torch.rand(2, 3, 96, 96) < 0.1)
    result = run_apg(model, prop, x, 2, 3)
    assert result.z["z_what"].shape == (3, 2, 2, 10)
    assert result.z["z_where_3"].shape == (3, 2, 2, 2)
    assert list(result.sweeps[-1].ess_blocks) == ["what", "where_1", "where_2", "where_3"]
    assert len(result.steps) == 1 + 4
    from apg.objectives import apg_loss

    apg_loss(result).backward()
    for name, module in (("decoder", model.decoder), ("where", prop.where_net), ("what", prop.what_net)):
        grads = [p.grad for p in module.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads), name
        assert any(g.abs().sum() > 0 for g in grads), name
    recon = task.reconstruct(model, x, result.z)
    assert recon.shape == (3, 2, 3, 96, 96) and recon.min() >= 0 and recon.max() <= 1


def test_template_memo_sees_parameter_updates():
    model = BouncingMNIST()
    z_what = torch.randn(2, 1, 3, 10)
    first = model.templates(z_what)
    assert model.templates(z_what) is first  # one decode per block update
    with torch.no_grad():
        model.decoder.net[-1].bias.add_(1.0)
    assert not torch.allclose(model.templates(z_what), first)


def test_a_model_and_proposals_with_their_memos_filled_pickle_without_them():
    """MLflow logs a trained cell pickled; the decode memos (weak references, tensors) are
    caches, left behind, and the unpickled networks compute the same numbers."""
    torch.manual_seed(0)
    model = BouncingMNIST()
    prop = bmnist.BMNISTProposals(model, "apg", 3)
    z_what = torch.randn(2, 1, 3, 10)
    templates, cross = prop._where_inputs(z_what)
    assert model._memo is not None and prop._where_memo is not None
    copy = pickle.loads(pickle.dumps(prop))
    assert copy._where_memo is None and copy.model[0]._memo is None
    assert model._memo is not None and prop._where_memo is not None  # the originals keep theirs
    again, again_cross = copy._where_inputs(z_what)
    assert torch.equal(again, templates) and torch.equal(again_cross, cross)


def test_where_inputs_of_resampled_copies_are_read_back_as_the_fresh_numbers():
    """The where kernels' templates and cross-correlation maps are kept across the where
    blocks of a sweep: for particles resampling copied or dropped they are read back by
    indexing, and are then the very numbers computed afresh."""
    torch.manual_seed(3)
    model = BouncingMNIST()
    prop = bmnist.BMNISTProposals(model, "apg", 3)
    z_what = torch.randn(6, 2, 3, 10)
    prop._where_inputs(z_what)
    ancestors = torch.tensor([[3, 3, 0, 5, 1, 1], [2, 0, 0, 4, 4, 5]]).T  # (L, B): copies and drops
    copies = z_what[ancestors, torch.arange(2)]
    templates, cross = prop._where_inputs(copies)
    assert prop._where_memo is not None and prop._where_memo[1] is z_what  # read back, not recomputed
    prop._where_memo = model._memo = None
    fresh, fresh_cross = prop._where_inputs(copies)
    assert torch.equal(templates, fresh) and torch.equal(cross, fresh_cross)


def test_where_inputs_memo_sees_new_weights():
    model = BouncingMNIST()
    prop = bmnist.BMNISTProposals(model, "apg", 2)
    z_what = torch.randn(2, 1, 2, 10)
    first, cross = prop._where_inputs(z_what)
    assert torch.equal(prop._where_inputs(z_what)[1], cross)
    with torch.no_grad():
        model.decoder.net[-1].bias.add_(1.0)
    again, _ = prop._where_inputs(z_what)
    assert not torch.allclose(again, first)
    assert torch.equal(again, model.decoder(z_what).detach())


def test_proposal_does_not_train_the_decoder():
    """eq. 5 trains phi only: the where kernel uses detached templates."""
    model = BouncingMNIST()
    prop = bmnist.BMNISTProposals(model, "apg", 2)
    x = torch.rand(1, 2, 96, 96)
    z = random_latents(2, 1, 2, 2)
    q = prop.kernel("where_1", x, z)
    q.log_prob(q.sample()).sum().backward()
    assert all(p.grad is None for p in model.decoder.parameters())
    assert not any(n.startswith("model") for n, _ in prop.named_parameters())


def test_rws_architecture_has_no_kernels():
    model = BouncingMNIST()
    prop = bmnist.build_proposals(model, "mlp", num_digits=2)
    x = torch.rand(1, 2, 96, 96)
    result = run_apg(model, prop, x, 1, 4)
    assert result.z["z_what"].shape == (4, 1, 2, 10)
    with pytest.raises(NotImplementedError):
        prop.kernel("what", x, result.z)
    with pytest.raises(ValueError, match="architecture"):
        bmnist.build_proposals(model, "lstm")


def test_num_digits_is_not_in_the_state_dict():
    model = BouncingMNIST()
    a = bmnist.build_proposals(model, "apg", num_digits=3)
    b = bmnist.build_proposals(model, "apg", num_digits=5)
    b.load_state_dict(a.state_dict())
    z, log_q = b.initial(torch.rand(1, 2, 96, 96), 2)
    assert z["z_what"].shape == (2, 1, 5, 10) and log_q.shape == (2, 1)


def test_animate_and_draw():
    model = BouncingMNIST()
    x = torch.rand(4, 96, 96)
    z = {k: v[0, 0] for k, v in random_latents(1, 1, 4, 3).items()}
    frames = bmnist.animate(model, x, z)
    assert frames.shape == (4, 96, 196, 3) and frames.dtype == np.uint8
    corner = np.round((z["z_where_1"][0].numpy() + 1) * 34).astype(int)
    assert (frames[0, corner[1], corner[0]] == bmnist.plots._COLORS[0]).all()
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    bmnist.draw(ax, x.numpy(), {k: v.numpy() for k, v in z.items()})
    assert len(ax.patches) == 4 * 3
    plt.close(fig)
    # Figure 3: a second row with the reconstructions, boxed the same way
    recon = bmnist.reconstruct(model, x[None], {k: v[None, None] for k, v in z.items()})[0, 0].detach()
    fig, ax = plt.subplots()
    bmnist.draw(ax, x.numpy(), {**{k: v.numpy() for k, v in z.items()}, "recon": recon.numpy()})
    assert len(ax.patches) == 2 * 4 * 3
    image = ax.get_images()[0].get_array()
    assert image.shape == (2 * 96 + 4, 4 * 96)
    assert np.allclose(image[100:, :96], recon[0].numpy(), atol=1e-6)
    plt.close(fig)
    # with the simulator's positions: the paths so far, inferred and true, in every frame
    truth = torch.stack([z[f"z_where_{t}"] for t in range(1, 5)]) * 0.5  # (T, D, 2)
    fig, ax = plt.subplots()
    bmnist.draw(ax, x.numpy(), {**{k: v.numpy() for k, v in z.items()}, "true_where": truth.numpy()})
    assert len(ax.patches) == 4 * 3 and len(ax.lines) == 4 * 3 + 4 * 3 * 2
    plt.close(fig)
    marked = bmnist.animate(model, x, {**z, "true_where": truth})
    centre = np.round((truth[0, 0].numpy() + 1) * 34).astype(int) + 14
    assert (marked[0, centre[1], centre[0]] == 255).all()
    assert (marked[:, :, 96:] == frames[:, :, 96:]).all()  # the reconstruction panel is unchanged


# --------------------------------------------------------------------------- training (slow)


@pytest.mark.slow
@needs_mnist
def test_training_lowers_heldout_mse_and_sweeps_help():
    from apg.training import TrainConfig, Trainer, evaluate

    torch.set_num_threads(1)
    task = get_task("bmnist")
    g = torch.Generator().manual_seed(0)
    sim_model = task.build_model()
    train = task.simulate(
        sim_model, 200, g, num_frames=5, num_digits=2, split="train", mnist_dir=str(MNIST_DIR)
    )
    # 90 held-out videos: with 30, the sweeps' gain after 80 steps was 2.5 to 7.4 standard
    # errors over training seeds 0-2 (the bar is 3), so rounding alone could fail it; with
    # 90, seeds 0 and 2 (the two lowest) gave 8.8 and 10.0.
    test = task.simulate(sim_model, 90, g, num_frames=5, num_digits=2, split="test", mnist_dir=str(MNIST_DIR))
    cfg = TrainConfig(
        task="bmnist",
        method="apg",
        sweeps=3,
        particles=4,
        batch_size=5,
        iterations=80,
        lr=1e-3,
        network={"num_digits": 2},
    )
    trainer = Trainer(cfg, train["x"])

    def mse() -> np.ndarray:
        return evaluate(
            cfg, trainer.model, trainer.proposals, test["x"], sweeps=4, particles=4, batch_size=10
        )["mse"]

    before = mse()
    for _ in trainer.run():
        pass
    after = mse()
    for name, (drop, se) in (
        ("training", mean_se(np.asarray(before[-1]) - np.asarray(after[-1]))),  # paired per video
        ("more sweeps", mean_se(np.asarray(after[0]) - np.asarray(after[-1]))),  # lower error
    ):
        assert drop > 3 * se, (name, drop, se)


def test_position_errors_match_digits_once_per_video():
    from apg.tasks.bmnist import TRACK_TOLERANCE_PX, position_errors

    gen = torch.Generator().manual_seed(0)
    truth = torch.rand(4, 6, 3, 2, generator=gen) * 1.6 - 0.8
    px = 0.5 * (96 - 28)  # pixels per model unit
    # The same digits in another order: no error, every frame tracked.
    swapped = truth[:, :, [2, 0, 1]]
    exact = position_errors(truth, swapped)
    assert np.allclose(exact["pos_err"], 0.0) and np.allclose(exact["tracked"], 1.0)
    # One digit of video 0 off by 2 px in x in every frame: 2/3 px mean, still tracked;
    # off by 4 px in one frame of video 1: 4 / (6 * 3) px, 5 of 6 frames tracked.
    shifted = swapped.clone()
    shifted[0, :, 1, 0] += 2.0 / px
    shifted[1, 2, 0, 1] += 4.0 / px
    err = position_errors(truth, shifted)
    assert err["pos_err"][0] == pytest.approx(2.0 / 3, rel=1e-6)
    assert err["pos_err"][1] == pytest.approx(4.0 / 18, rel=1e-6)
    assert err["tracked"][0] == 1.0 and err["tracked"][1] == pytest.approx(5 / 6)
    # A constant shift is all offset: no motion error. The one-frame jump is motion.
    assert err["pos_err_aligned"][0] == pytest.approx(0.0, abs=1e-5)  # float32 inputs
    jump = torch.zeros(6, 2)
    jump[2, 1] = 4.0
    assert err["pos_err_aligned"][1] == pytest.approx(
        float((jump - jump.mean(0)).norm(dim=-1).sum()) / 18, rel=1e-6
    )
    assert TRACK_TOLERANCE_PX == 3.0
    # Matching is per video: digits that trade places half-way are not a perfect track.
    traded = truth.clone()
    traded[:, 3:] = truth[:, 3:, [1, 0, 2]]
    # (per frame, every frame would match exactly; per video, half the frames of two digits are off)
    far = (truth[:, :, 0] - truth[:, :, 1]).norm(dim=-1) * px  # (M, T)
    expected = torch.minimum(far[:, 3:].sum(1), far[:, :3].sum(1)) * 2 / (6 * 3)
    traded_err = position_errors(truth, traded)
    assert np.allclose(traded_err["pos_err"], expected.numpy())
    # Matched per frame, the traded boxes are on the digits: a localization error of 0, and
    # the frames after the trade (every box within 3 px of some digit, not of its own) are
    # swapped wherever the two digits are more than 3 px apart.
    assert np.allclose(traded_err["pos_err_frame"], 0.0) and np.allclose(traded_err["tracked_frame"], 1.0)
    apart = (far[:, 3:] > TRACK_TOLERANCE_PX).double().sum(1) / 6
    kept_half = far[:, 3:].sum(1) <= far[:, :3].sum(1)  # the video's matching follows the first half
    swapped = torch.where(kept_half, apart, (far[:, :3] > TRACK_TOLERANCE_PX).double().sum(1) / 6)
    assert np.allclose(traded_err["swapped"], swapped.numpy()) and (swapped > 0).all()
    assert np.allclose(traded_err["swapped"], traded_err["tracked_frame"] - traded_err["tracked"])
    # Without a trade, per-frame and per-video matching agree and nothing is swapped.
    assert np.allclose(err["pos_err_frame"], err["pos_err"]) and np.allclose(err["swapped"], 0.0)
    with pytest.raises(ValueError, match="positions must both be"):
        position_errors(truth, truth[:, :, :2])


def test_position_error_compares_where_the_ink_is():
    """A decoder that draws its digit 2 px to the right, in a box 2 px to the left of the
    true box, makes the same frame: no position error, a 2 px boxes' error."""
    from apg.tasks.bmnist import ink_centres, position_errors

    digit = torch.zeros(28, 28)
    digit[10:18, 12:16] = 1.0  # ink centre (column 13.5, row 13.5)
    assert torch.allclose(ink_centres(digit), torch.tensor([13.5, 13.5]))
    drawn = torch.roll(digit, 2, dims=1)  # the decoder's template: 2 px to the right
    assert torch.allclose(ink_centres(drawn), torch.tensor([15.5, 13.5]))
    assert torch.allclose(ink_centres(torch.zeros(2, 28, 28)), torch.full((2, 2), 13.5))  # empty: box centre
    px = 0.5 * (96 - 28)
    truth = torch.rand(3, 5, 1, 2, generator=torch.Generator().manual_seed(1)) * 1.6 - 0.8
    where = truth.clone()
    where[..., 0] -= 2.0 / px  # box 2 px to the left
    true_centres = ink_centres(digit).expand(3, 1, 2)
    centres = ink_centres(drawn).expand(3, 1, 2)
    err = position_errors(truth, where, true_centres=true_centres, centres=centres)
    assert np.allclose(err["pos_err"], 0.0, atol=1e-5) and np.allclose(err["tracked"], 1.0)
    assert np.allclose(err["box_err"], 2.0, rtol=1e-5)
    # the same box offset with a centred template is a 2 px error
    err = position_errors(truth, where, true_centres=true_centres, centres=true_centres)
    assert np.allclose(err["pos_err"], 2.0, rtol=1e-5) and "box_err" in err
    with pytest.raises(ValueError, match="both"):
        position_errors(truth, where, true_centres=true_centres)
    with pytest.raises(ValueError, match="centres must be"):
        position_errors(truth, where, true_centres=true_centres, centres=centres[:, :, :1])


def test_where_network_can_start_as_a_soft_argmax():
    """``read_coordinates``: before any training, a map peaked at one offset gives a mean
    within 0.1 model units (3.4 px) of that offset's position; random weights do not."""
    from apg.tasks.bmnist import WhereNet

    torch.manual_seed(0)
    side = 69
    peaks = torch.tensor([[10, 40], [34, 34], [60, 5], [3, 66]])  # (row, column)
    maps = torch.full((len(peaks), side, side), -50.0)
    maps[torch.arange(len(peaks)), peaks[:, 0], peaks[:, 1]] = 0.0
    expected = peaks.flip(-1).double() / 34 - 1  # (column, row) in model coordinates
    read = WhereNet(side * side, read_coordinates=True)(maps).loc.double()
    assert (read - expected).abs().max() < 0.1
    random = WhereNet(side * side)(maps).loc.double()
    assert (random - expected).abs().max() > 0.3


def test_encoder_where_network_shared_or_its_own():
    from apg.tasks.bmnist import build_model, build_proposals

    model = build_model()
    shared = build_proposals(model, "apg", 1, share_where_net=True)
    own = build_proposals(model, "apg", 1)
    assert shared.initial_where_net is None
    assert not any(k.startswith("initial_where_net") for k in shared.state_dict())
    assert sum(p.numel() for p in own.parameters()) == sum(p.numel() for p in shared.parameters()) + sum(
        p.numel() for p in own.where_net.parameters()
    )
    x = torch.zeros(2, 3, 96, 96)
    z, log_q = own.initial(x, 4)
    assert z["z_where_1"].shape == (4, 2, 1, 2) and torch.isfinite(log_q).all()
    # RWS has no kernels: its one position network is the encoder's
    assert build_proposals(model, "mlp", 1).initial_where_net is None


def test_the_encoders_position_scale_has_its_floor_and_the_kernels_keep_theirs():
    """However far the scale head pushes down, the encoder's position proposal keeps a scale
    of ``encoder_min_scale`` (about a pixel), RWS's one network too; APG's kernels keep 1e-3."""
    from apg.tasks.bmnist import build_model, build_proposals

    model = build_model()
    corr = torch.randn(2, 3, 69, 69)
    apg_props, rws_props = build_proposals(model, "apg", 1), build_proposals(model, "mlp", 1)
    nets = {
        "encoder": apg_props.initial_where_net,
        "kernel": apg_props.where_net,
        "rws encoder": rws_props.where_net,
    }
    for net in nets.values():
        with torch.no_grad():
            net.scale[-1].bias.fill_(-100.0)  # softplus -> 0
    scales = {name: net(corr).scale for name, net in nets.items()}
    assert torch.allclose(scales["encoder"], torch.tensor(0.03))
    assert torch.allclose(scales["rws encoder"], torch.tensor(0.03))
    assert torch.allclose(scales["kernel"], torch.tensor(1e-3))
    assert build_proposals(model, "apg", 1, encoder_min_scale=0.1).initial_where_net(corr).scale.min() >= 0.1
