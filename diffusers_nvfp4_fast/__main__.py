"""``python -m diffusers_nvfp4_fast``: the ``diffusers-nvfp4-fast`` command line."""

from .commands.cli import main

raise SystemExit(main())
