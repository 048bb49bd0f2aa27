"""Where a script writes its files: never over a file that is there already (a picture committed
in docs/, say) unless the user asks with overwrite=true. A script's own folder (the study it
summarises) is its to rewrite."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from safeio.cli import UserError
from safeio.files import check_output_file


def check_outputs(files: list[Path], overwrite: bool, own: Optional[Path] = None) -> None:
    """Refuse, naming the first, files that exist outside `own` when overwrite is false; refuse
    outputs that are not files (a directory of that name)."""
    for path in files:
        if path.is_dir():
            raise UserError(f"{path} is a directory; give another out=")
        check_output_file(path, "out=")  # a FIFO or a device is named as what it is
        inside = own is not None and path.resolve().parent == own.resolve()
        if path.exists() and not inside and not overwrite:
            raise UserError(f"{path} exists (a committed picture?); add overwrite=true to replace "
                            f"it, or give another out=")
