"""The precision advisor: `advise(model, inputs, max_error=...)` measures each
module's sensitivity, latency and bytes under candidate policies on this
machine and returns the `Advice` whose policy map meets the error budget.

The package's modules, one job each: `batches` (inputs), `errors` (the
end-to-end error), `candidates`, `units` (which modules, and the recorded
pass), `grouping` (modules sharing an input or a weight), `variants` (a
module under one candidate), `sensitivity`, `latency`, `selection`, `verify`
(back-off) and `advice` (the result).
"""

from dtype_policies.advisor.advice import Advice, ModuleAdvice
from dtype_policies.advisor.candidates import DEFAULT_CANDIDATES
from dtype_policies.advisor.errors import relative_error
from dtype_policies.advisor.runner import advise

__all__ = ["DEFAULT_CANDIDATES", "Advice", "ModuleAdvice", "advise", "relative_error"]
