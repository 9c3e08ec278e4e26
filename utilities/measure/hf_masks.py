"""What a real step of a transformers model reads from its batch's values, answered for the fake
step, whose tensors have no values.

transformers decides two things from the values of an unpadded batch: that no token is padding
(no attention mask, or an all-ones one: ``masking_utils._ignore_causal_mask_sdpa``), and that each
row holds one sequence (``masking_utils.find_packed_sequence_indices`` on the position ids). Both
answers let its SDPA attention skip the mask: ``is_causal=True`` and, for grouped-query attention,
``enable_gqa=True`` with K/V of the key/value heads only (``integrations.sdpa_attention``). On fake
tensors it cannot read the values, so it builds a seq x seq mask and repeats K/V to every query
head, bytes a real step never holds. The fake step feeds no mask (``fake_step.fake_batch``) and,
while it runs, ``one_sequence_per_row`` gives the packed-sequence check the answer a real batch of
the planner's gives: one sequence per row."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def one_sequence_per_row():
    """While inside: transformers' packed-sequence check answers "not packed" (None), as it does
    on a real batch whose position ids count 0..seq-1 in every row. A transformers without that
    check (before 4.53) or without transformers: nothing changes."""
    try:
        from transformers import masking_utils
    except ImportError:
        masking_utils = None
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = _not_packed
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _not_packed(position_ids):
    """The packed-sequence check's answer for rows that each hold one sequence."""
    return None
