"""Network pieces shared by the tasks' proposals."""

from __future__ import annotations

from torch import Tensor, nn


class PointFeatures(nn.Module):
    """Per-point features of a dataset, ``(..., N, F_in) -> (..., N, out_dim)``.

    ``linear``: the identity (Appendix E's APG encoders read x_n directly); ``mlp``: two
    tanh layers applied to each point; ``lstm``: an LSTM over the point sequence (the
    RWS-LSTM baselines of section 5.1).
    """

    def __init__(self, kind: str, in_dim: int, hidden: int):
        super().__init__()
        self.kind = kind
        self.out_dim = in_dim if kind == "linear" else hidden
        if kind == "mlp":
            self.net: nn.Module = nn.Sequential(
                nn.Linear(in_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh()
            )
        elif kind == "lstm":
            self.net = nn.LSTM(in_dim, hidden, batch_first=True)
        elif kind != "linear":
            raise ValueError(f"unknown point-feature network {kind!r}; choose linear, mlp or lstm")

    def forward(self, u: Tensor) -> Tensor:
        if self.kind == "linear":
            return u
        if self.kind == "mlp":
            return self.net(u)
        lead = u.shape[:-2]
        out, _ = self.net(u.reshape(-1, *u.shape[-2:]))
        return out.reshape(*lead, *out.shape[-2:])
