"""Pure logic: no I/O, no clocks, no environment. Table-tested."""
