"""Grid dependency control for kernels launched with ``launch.pdl_options`` (programmatic dependent launch, SM90+).

A kernel launched that way may have its CTAs placed on the GPU before the kernel ahead of it in the stream has
finished. Each one therefore first waits until every grid it depends on has completed and its memory is visible
(``griddepcontrol.wait``), and only then lets the next such kernel be placed (``griddepcontrol.launch_dependents``):
after that point it reads and writes memory exactly as under stream order, so the bytes are those of a plain launch.
What it saves is the launch gap and the CTA placement between two kernels (docs/performance.md, "Kernel boundaries").
PTX has both instructions from SM90 on; ``PDL`` is False for older targets, where the kernel compiles without them.
"""

import triton
import triton.language as tl

# The two instructions, each as inline PTX with a dummy output; the Gluon GEMM emits the same strings.
WAIT_ASM = tl.constexpr("griddepcontrol.wait; // $0")
RELEASE_ASM = tl.constexpr("griddepcontrol.launch_dependents; // $0")


@triton.jit
def wait_for_prior_grids(PDL: tl.constexpr):
    """First statement of a kernel launched with ``launch.pdl_options``: nothing of the kernel may touch global memory
    before it."""
    if PDL:
        tl.inline_asm_elementwise(WAIT_ASM, "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.inline_asm_elementwise(RELEASE_ASM, "=r", [], dtype=tl.int32, is_pure=False, pack=1)
