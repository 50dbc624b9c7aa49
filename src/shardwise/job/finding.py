"""One finding of a profile as summary.json holds it, shared by job/remedy.py and
job/remedy_sharded.py."""

from __future__ import annotations


def finding(cause: str, evidence: str, remedy: list[str], step_s: float, new_s: float) -> dict:
    """`{cause, evidence, remedy, predicted_step_s, predicted_gain}` for a step of `step_s`
    predicted to take `new_s` (kept between 0 and `step_s`)."""
    new_s = min(step_s, max(new_s, 0.0))
    return {
        "cause": cause,
        "evidence": evidence,
        "remedy": remedy,
        "predicted_step_s": round(new_s, 6),
        "predicted_gain": round(1.0 - new_s / step_s, 4) if step_s else 0.0,
    }


def pct(x: float, step_s: float) -> str:
    """Seconds per step as ms and as a share of the step."""
    return f"{x * 1000:.1f} ms/step ({100 * x / step_s:.0f}% of {step_s * 1000:.0f} ms)"
