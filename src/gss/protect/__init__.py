"""gss protect: find what a model regurgitates and choose the steer that removes it, in one call.

The search, step by step (docs/protect.md says why each step is there):

1. **Audit** the fine-tuning rows (`gss.audit`). A row is *memorized* when greedy decoding
   from its first k tokens reproduces it to token n and the reference's does not (with
   ``memorized_from="shortest"``: from the shortest scored prompt, where it is then measured).
2. **Split** the memorized rows, seeded, into a tuning half and a held-out half. The held-out
   rows are not calibrated on and not measured during the search: only the final report reads
   them, so its numbers are what a user can expect on memorized text the search never saw.
3. **General text** sets the gate thresholds and measures how often the gates open: the
   user's sample (their traffic) when given, text the reference generates from short prompts,
   and ordinary English every Python ships (`ordinary`); half of each source sets its own
   thresholds (the highest kept: no source opens the gates more than asked), the other half
   measures the open share.
4. **Candidates**: every block of a model with at most ``max_candidates`` blocks; otherwise the
   blocks with the strongest signal (`gss.scan_layers`) and evenly spaced ones, since on a full
   fine-tune the strongest signal is not always the block that removes the most.
5. **Strength**: for each (preset, block), a bisection on log(delta) finds the strongest steer
   within the utility budget and the data's clean rows' (`checks`). The best point (the target
   reached, then the reference's continuations likeliest, then the fewest tokens still
   reproduced) seeds the next stages: other ranks, other gates.
6. **A second block**, calibrated on the model already steered, when one block does not reach
   the target within the budget; the first block's strength is lowered to share the budget.
7. **Replies** (``SearchSpace.reply_check``, 4 by default): the best few points equal on the
   target generate continuations of the tuning prompts; the first that repeats at most
   ``loop_tolerance`` points of 4-grams more than the reference's own and reads to the
   reference at most ``fluency_ratio`` times as perplexing is chosen.
8. **The hand-over rule** (``SearchSpace.handoff_unchanged``): for who keeps the reference at
   inference, where it should speak, at the steer's gates or at any step, measured on the
   tuning rows and ordinary prompts and saved with the steer (`handover`).

Where: `search` composes the steps; `config` is what a run is told before the data
(`ProtectConfig`, with `space`'s `SearchSpace`: what may be chosen); `split` is steps 1-2,
`general` step 3 and the budget, `stages` steps 4-7 (`Search`), `handover` step 8; `measure`
measures one point (`Judge`: rows still extractable, utility) and bisects a strength; `checks`
is what else every point is held to; `ordinary` the built-in ordinary English; `replies` what
a steer says instead; `heldout` the final report's measurements; `result` is what comes back
(`Protection`) and the report it writes.
"""

from gss.protect.config import ProtectConfig
from gss.protect.general import reference_text
from gss.protect.measure import Utility
from gss.protect.result import OUTPUTS, Protection, Trial, check_report_dir
from gss.protect.search import protect
from gss.protect.space import SearchSpace

__all__ = [
    "OUTPUTS",
    "ProtectConfig",
    "Protection",
    "SearchSpace",
    "Trial",
    "Utility",
    "check_report_dir",
    "protect",
    "reference_text",
]
