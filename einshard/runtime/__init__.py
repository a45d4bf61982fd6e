"""Running planned operations: transitions bound to a rank (execute), the front end every operation shares
(pipeline), variance tracking (vma), distributed formulas, and activation checkpointing."""
