"""The Pallas engine: `launch` pads and lays out the operands and runs the kernels, `calls` owns the
`pallas_call`s (grids, BlockSpecs, Mosaic or interpret), `kernels` holds the Ref-only bodies,
`block_sizes` the per-chip tiles and the VMEM model."""
