"""Why a strict manager's filter matched nothing: the likely slips, each with its fix, for
:class:`~graphmod.errors.ManagerMatchedNothing` (roles the manager's hooks are never
offered, a path naming a brick where ``path=`` globs variables, a name no variable has, a
method that is no application)."""

from __future__ import annotations

import fnmatch
import re

from graphmod import roles as _roles
from graphmod._core._managers._manager import Manager
from graphmod._core._model._layout import Layout
from graphmod._core._selection._filter import brick_globs, rooted

__all__ = ["unmatched_hints"]

# What each rewriting hook sees: the roles of the values it is offered.
_HOOK_ROLES = (("rewrite_input", "inputs", (_roles.INPUT, _roles.TARGET)),
               ("rewrite_output", "outputs", (_roles.OUTPUT, _roles.COST)),
               ("rewrite_parameter", "parameters", (_roles.PARAMETER,)))


def unmatched_hints(manager: Manager, layout: Layout) -> str:
    """Likely slips behind ``manager``'s filter matching nothing in the model of
    ``layout``, as sentences (empty if none is seen).

    Examples:
        >>> import jax, graphmod as gm, managers
        >>> from flax import nnx
        >>> mlp = gm.bricks.MLP([2, 3, 1], activation=jax.nn.relu, rngs=nnx.Rngs(0))
        >>> layout = gm.compile(lambda m, x: m(x), mlp).layout
        >>> hints = unmatched_hints(managers.Dropout(0.1, path="linear_layers/0"), layout)
        >>> "names the brick /linear_layers/0" in hints, "path='/linear_layers/0.*'" in hints
        (True, True)
    """
    f, kind, hints = manager.filter, type(manager).__name__, []
    hooks = [(what, roles) for hook, what, roles in _HOOK_ROLES if manager.has_hook(hook)]
    if manager.wraps_only and any(x is not None for x in (f.roles, f.name, f.name_regex)):
        hints.append(f"{kind} wraps whole application calls: select them by bricks=, "
                     "applications= or path=, not by roles= or name=")
    elif hooks and f.roles is not None and not any(
            r.is_a(h) or h.is_a(r) for r in f.roles for _, roles in hooks for h in roles):
        hints.append(f"{kind} rewrites the {' and '.join(w for w, _ in hooks)} of "
                     f"application calls, none of roles={[r.name for r in f.roles]}")
    if f.roles is not None and manager.has_hook("rewrite_parameter"):
        hints += _role_hints(f.roles, layout)
    if f.roles is not None and any(r.is_a(_roles.TARGET) for r in f.roles):
        hints.append("TARGET variables are the targets of an application that declares them "
                     "(graphmod.bricks.SoftmaxCrossEntropy, @graphmod.application(targets="
                     "[...])); a loss written as a function over a Flax model's logits has "
                     "none: call a cost brick, or apply optax.smooth_labels in the loss")
    if f.bricks is not None and f.path is None:
        hints.append("bricks= selects those bricks' own calls (their inputs, outputs and own "
                     "parameters), not their children's: select the layers inside by class "
                     "(bricks=[nnx.Conv]) or by path (path='/block/*')")
    if f.path is not None:
        hints += _path_hints(f.path, manager.wraps_only, layout)
    if f.name is not None:
        names = sorted({info.name for info in layout.variables})
        hints.append(f"The model's variables are named {', '.join(names[:12])}"
                     f"{', ...' if len(names) > 12 else ''}; an application's inputs are "
                     "named after its arguments, its output 'output'")
    if f.applications is not None:
        if "__call__" in f.applications:
            hints.append("A module's __call__ is the application named 'apply' "
                         "(applications=['apply'])")
        hints.append("A method other than __call__ is an application call when it is a "
                     "@graphmod.application or compile(applications={TheClass: ['method']}) "
                     "names it")
    return "".join(f" {hint}." for hint in hints)


def _path_hints(glob: str, calls: bool, layout: Layout) -> list[str]:
    """A path that names a brick where ``path=`` globs the paths of variables (of calls,
    for a manager that only wraps them), that does not start with '/', or that names
    nothing there is."""
    path = rooted(glob)
    bricks = [b for b in layout.bricks_at if b != "/"]
    paths = [f"{b}.apply" for b in bricks] if calls else [i.path for i in layout.variables]
    if path != glob and any(fnmatch.fnmatchcase(p, path) for p in paths):
        return [f"Paths start with '/' (path={path!r}?)"]
    named = [b for b in bricks if fnmatch.fnmatchcase(b, path)]
    if not named:
        # A path as a variables table or the variables' dict spell it: model/linear1/kernel
        base, _, last = glob.removeprefix("model/").strip("/").rpartition("/")
        dotted = f"/{base}.{last}" if base else f"/.{last}"
        if not calls and any(fnmatch.fnmatchcase(p, dotted) for p in paths):
            return [f"A variable's path is its brick's, a dot and its name (path={dotted!r}?)"]
        # A call's path and a variable's name together: /layers/1.apply.b
        brick_name = re.sub(r"\.[^./]+(\.[^./]+)$", r"\1", path)
        if not calls and brick_name != path and any(fnmatch.fnmatchcase(p, brick_name)
                                                     for p in paths):
            return [f"A variable's path is its brick's, a dot and its name, with no "
                    f"application (path={brick_name!r}?)"]
        return [f"The model's bricks are at {', '.join(bricks[:8])}"
                f"{', ...' if len(bricks) > 8 else ''}"] if bricks else []
    brick, more = named[0], " and more" if len(named) > 1 else ""
    if calls:
        form = f"calls (the brick's, a dot, the application: '{brick}.apply')"
    else:
        example = next((info.path for info in layout.variables
                        if info.path.rpartition(".")[0] == brick), f"{brick}.kernel")
        form = f"variables (the brick's, a dot, the variable's name: '{example}')"
    return [f"path={glob!r} names the brick {brick}{more}: path= globs the paths of {form}, "
            f"so write {brick_globs(path)}"]


def _role_hints(wanted: tuple[_roles.Role, ...], layout: Layout) -> list[str]:
    """The roles the model's parameters have, when none has one of ``wanted`` (a Flax
    layer's weight named ``w`` is a PARAMETER, not a WEIGHT), or that it has none."""
    parameters = [i for i in layout.variables if i.role.is_a(_roles.PARAMETER)]
    if not parameters:
        return ["The model holds no parameters at all (no nnx.Param or graphmod.Parameter): "
                "there is none for it to select; leave it out of this program"]
    if any(i.role.is_a(r) for i in parameters for r in wanted):
        return []
    names: dict[str, list[str]] = {}
    for info in parameters:
        names.setdefault(info.role.name, []).append(info.name)
    have = "; ".join(f"{role} ({', '.join(sorted(set(n))[:4])})" for role, n in names.items())
    return [f"The model's parameters are {have}: a parameter's role comes from its name "
            "(kernel and embedding are WEIGHT, bias BIAS, any other name PARAMETER), so "
            "select these by roles=[PARAMETER] or variable_name="]
