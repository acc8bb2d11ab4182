"""The ``diffusers-nvfp4-fast`` commands: ``cli`` parses the arguments and hands over to ``inspect``
(``loaders.inspect``), ``quantize`` (``quantize.transformer``), ``demo`` or ``selftest``."""
