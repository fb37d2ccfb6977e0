"""The pass loop (DESIGN.md §4) and its collectives: the runner, the one exchange per pass, a fetched part
applied to a rank's branches, where layer parts come from, rank 0's monitor. Imports finish/ and kinds/."""
