"""Protected paths inside writable projects: what an agent could plant for a human to run later.

Git runs ``.git/hooks/*`` and what its config says (``core.fsmonitor``, ``core.hooksPath``, aliases)
when the human next uses the repository; harness config (``.claude/``, ``.mcp.json``, …) decides
what the human's next agent may do; ``.envrc`` and shell rc files run in the human's shell.

Two mechanisms, because the first cannot cover everything:

* **Read-only binds** (prevention) for every such entry that exists when the cell starts, at each
  writable root and in every repository found below it: hooks and config of every git directory
  (submodules' too, at any depth), ``.git`` files (submodule and worktree links), and the harness and
  shell names. Every ``.git`` directory, and each directory down to a nested repository, is bound
  onto itself so it cannot be renamed away and rebuilt. ``git add``/``commit`` keep working.
* **A before/after comparison** of the whole control surface — the entries above, the files through
  which git finds another config or hooks (``commondir``, ``config.worktree``, a worktree's
  ``commondir``/``gitdir``), every ``.git`` entry and every directory shaped like a git directory
  (``HEAD`` with ``objects`` or ``refs``: git takes it for a bare repository). An entry that did not
  exist cannot be bound, so what the command *created* is **quarantined** after the run
  (:func:`agentcell.protect.check.quarantine`): moved into a new
  ``.agentcell-quarantine-<cell id>-<random>/`` at the top of its writable path (0700, the human's
  behind sudo, else the supervisor's), where no tool looks
  and a git directory is no longer where git finds it. Only entries that are part of the structure
  (not a file some config names), absent before the run and born during it (ctime), outside --ro
  and --mask paths; when the scan before the run was cut short, only those owned by the cell's own
  uid (a rootless cell has none: then nothing moves). Their content is kept for review. What was
  changed or removed (``.git`` stays writable for git's own work) is reported; undoing it is the
  snapshot's job.

Modules: :mod:`.surface` (what is protected: the scan of the writable paths, the control surface's
state and what a change of it means), :mod:`.binds` (what the policy adds to a cell's mount plan: the
read-only binds and pinned ``.git`` directories), :mod:`.check` (the run protocol's protected-path
step: the before/after comparison and the quarantine).
"""
