"""``netutility convert SRC_FOLDER OUT_FOLDER``: an adapter's tensors (a pickled
``adapter_model.bin`` read without torch, or safetensors) written as ``adapter_model.safetensors``
with the same config, atomically."""

from __future__ import annotations

import argparse
import pathlib

from ..errors import FileAccessError, InputError, MissingFileError
from .common import check_extras
from .paths import check_adapter_dir, check_convert_out, clean_staging, write_folder

__all__ = ["cmd_convert"]


def cmd_convert(args: argparse.Namespace) -> int:
    """``netutility convert SRC_FOLDER OUT_FOLDER``: SRC's tensors (a pickled
    ``adapter_model.bin``, read without torch and without running its pickle; or safetensors, or
    shards) written as ``adapter_model.safetensors`` (names, shapes, dtypes and values
    unchanged) with SRC's ``adapter_config.json`` byte for byte, into OUT atomically
    (:func:`write_folder`); SRC is only read. Prints one line."""
    from .. import peft

    fn = f"SRC_FOLDER {args.src}"  # (the library's messages start with it; the path follows)
    src = check_adapter_dir(args.src)
    out, replace = check_convert_out(args.out, args.src, overwrite=args.overwrite)
    check_extras(need_plots=False)
    import safetensors

    peft.load_config(src)  # (a readable JSON object, or the loader's message)
    try:
        config = (src / peft.CONFIG_NAME).read_bytes()
    except PermissionError as e:
        raise FileAccessError(f"{fn}: cannot be read ({e}).") from e
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:  # changed under us
        raise MissingFileError(f"{fn}: cannot be read ({e}).") from e
    wf, tensors = peft.read_tensors(src, fn=fn)

    def fill(tmp: pathlib.Path) -> None:
        try:  # (a failed write is an OSError, which write_folder reports)
            peft.save_tensors(tensors, tmp / peft.WEIGHTS_NAME)
        except safetensors.SafetensorError as e:  # (a dtype safetensors cannot hold)
            raise InputError(f"{fn}: {str(wf)!r}: cannot be written as safetensors ({e}).") from e
        (tmp / peft.CONFIG_NAME).write_bytes(config)

    if out.parent.is_dir():
        clean_staging(out.parent, "convert")
    write_folder(out, f"OUT_FOLDER {args.out}", fill, replace=replace, command="convert")
    dtypes = sorted({str(t.dtype) for t in tensors.values()})
    nbytes = sum(t.nbytes for t in tensors.values())
    print(
        f"converted {args.src} ({wf.name}: {len(tensors)} tensors, {', '.join(dtypes)}, "
        f"{nbytes} bytes) -> {out / peft.WEIGHTS_NAME}"
        + (" (replaced the folder that was there)" if replace else "")
    )
    return 0
