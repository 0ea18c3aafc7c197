"""An alert, the kinds there are, and the Markdown table they are written as.

What the health rules (:mod:`layerwatch.health.check`, :mod:`layerwatch.health.rules`), the first
offender and the spike check say: one :class:`Alert` each. No torch: ``layerwatch report`` reads
the table back (:func:`parse_alerts_markdown`) without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

KINDS = ("dead", "stuck", "exploding", "vanishing", "nonfinite", "spike", "sign_like", "eps_bound", "attention_logits",
         "entropy_collapse", "logit_drift", "outlier_growth", "loss_rise", "router_collapse", "dead_expert",
         "router_z_growth", "routing_entropy_collapse")
EVENT_KINDS = ("spike", "loss_rise")  # raised at each step they happen; the others once per layer
# judged only once the loss has turned (LossProgress.turned): they come with healthy learning too
GROWTH_KINDS = ("sign_like", "attention_logits", "entropy_collapse", "logit_drift", "outlier_growth", "router_z_growth",
                "routing_entropy_collapse")


@dataclass(frozen=True)
class Alert:
    """One health problem: what, where, first seen when, in one line a person understands."""

    kind: str
    name: str
    step: int
    message: str

    def as_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "name": self.name, "step": self.step, "message": self.message}



def alerts_markdown(alerts: Iterable[Alert]) -> str:
    """A Markdown table, as TensorBoard's Text tab shows it and ``layerwatch report`` reads it back."""
    lines = ["| kind | name | step | message |", "|---|---|---|---|"]
    lines += [f"| {a.kind} | {_cell(a.name)} | {a.step} | {_cell(a.message)} |" for a in alerts]
    return "\n".join(lines)


def parse_alerts_markdown(text: str) -> list[Alert]:
    """The alerts of a table written by :func:`alerts_markdown`."""
    alerts = []
    for line in text.splitlines()[2:]:
        cells = [c.strip().replace("\\|", "|") for c in _split_cells(line)]
        if len(cells) == 4 and cells[2].isdigit():
            alerts.append(Alert(cells[0], cells[1], int(cells[2]), cells[3]))
    return alerts


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _split_cells(line: str) -> list[str]:
    """Cells of ``| a | b |``, honouring ``\\|`` inside a cell."""
    cells, current, i = [], "", 0
    body = line.strip()
    if not (body.startswith("|") and body.endswith("|")):
        return []
    body = body[1:-1]
    while i < len(body):
        if body[i] == "\\" and i + 1 < len(body) and body[i + 1] == "|":
            current += "\\|"
            i += 2
            continue
        if body[i] == "|":
            cells.append(current)
            current = ""
        else:
            current += body[i]
        i += 1
    cells.append(current)
    return cells
