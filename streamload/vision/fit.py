"""Whether an image-text sample fits a row: its images and patches under the caps per row
(`max_images_per_row`, `max_patches_per_row`: OmniBal's caps per packed group, which the planner
keeps, `plan/caps.py`). A sample over a cap on its own fits no row: the loader's transform
(`pipeline/images.py`) and the dry run's scan (`commands/dryrun/scan.py`) both refuse it with
this message, a record error naming it (or, with on_error="skip", a counted skip)."""
from __future__ import annotations

from typing import Optional, Sequence


def over_row_caps(patches: Sequence[int], max_images: Optional[int],
                  max_patches: Optional[int]) -> Optional[str]:
    """Why a sample whose images have `patches` patches each fits no row (None: it fits)."""
    if max_images is not None and len(patches) > max_images:
        return (f"{len(patches)} images, more than max_images_per_row={max_images}: the "
                f"sample fits no row; raise the cap")
    total = int(sum(patches))
    if max_patches is not None and total > max_patches:
        return (f"{total} encoder patches in {len(patches)} image(s), more than "
                f"max_patches_per_row={max_patches}: the sample fits no row; raise the cap or "
                f"lower images.max_pixels (the rule resizes to at most "
                f"max_pixels / patch_size**2 patches per image)")
    return None
