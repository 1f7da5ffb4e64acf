/*
 * agentcell's session lifecycle, for SPIN (Debian's `spin`). tests/test_model.py checks every property
 * below and every revert model; model/README.md says what is modelled, what is not, and how to run it.
 *
 * Taken from the code, step for step:
 *   the graph (src/agentcell/session/graph.py): plan -> policy -> preflight -> account -> firewall -> spawn
 *     -> monitor (loop) -> terminate -> cleanup -> audit; abort -> cleanup; its retry rules and error routes;
 *   each node's effects on the host, in the code's order (session/nodes/*.py), its audit record
 *     (audit/trail.py), then LangGraph's checkpoint (durability "sync": after every node);
 *   the per-session account (accounts/ephemeral.py) from a uid range shared by every session;
 *   the cell host (host/server.py run_once, supervise.py Supervised): a process of its own that adopts the
 *     session's firewall table, opens the monitor, makes the cgroup, runs the agent, and ends the cell when
 *     its monitor gives a verdict, when asked, or when its supervisor is gone (EOF);
 *   `agentcell session recover` (graph.recover): for a session whose supervisor is dead and whose audit node
 *     has not run, terminate -> cleanup -> audit from the checkpoint alone;
 *   the monitor's host programs (monitor/hostprog.py, calls.py): one copy attached for the whole host, held
 *     by each process that uses them (a cell host's monitor; the warm launcher, as root), joined from a live
 *     holder listed in /run/agentcell/calls.json or loaded and attached anew, under the list's lock; the
 *     kernel detaches them when the last holder closes its fds; a cell's rings in their maps from before its
 *     command runs to after its end.
 * A crash (SIGKILL) may hit the supervisor, a recover, a cell host or the warm launcher between any two of their
 * effects, and an audit writer between its record and its anchor. The mode modelled is the one with the most host-side state:
 * a per-session account (root) and --net host-firewall.
 */

#ifndef N
#define N 2             /* sessions at once */
#endif
#ifndef U
#define U 2             /* uids in the per-session range (ephemeral.UID_FIRST..UID_LAST) */
#endif
#ifndef CRASHES
#define CRASHES 1       /* SIGKILLs, in all: a supervisor, a recover, a cell host */
#endif
#ifndef FAULTS
#define FAULTS 1        /* failures a node raises (what the retry rules retry) */
#endif
#ifndef REFUSALS
#define REFUSALS 1      /* audit records the disk refuses (after the trail's own 3 retries) */
#endif
#ifndef TICKS
#define TICKS 1         /* monitor ticks before the wall clock ends a session */
#endif
#ifndef LAUNCHER
#define LAUNCHER 1      /* the warm launcher (root) holds the host programs for a while: 1, or 0 (none) */
#endif

#define NOUID 255
#define NONE 255

/* Processes that may hold the host programs ("holders", each a pid of its own, never given again): the cell
   hosts of session s (at most SPAWN_ATTEMPTS of them: holder SPAWN_ATTEMPTS*s + attempt), then the launcher. */
#define H (SPAWN_ATTEMPTS * N + 1)
#define LH (SPAWN_ATTEMPTS * N)   /* the launcher's */
#define K H             /* copies of the programs that can exist at once: one a holder, at most */

/* The retry rules (graph.py's RetryPolicy max_attempts; tests/test_model.py compares them) */
#define PREFLIGHT_ATTEMPTS 3    /* 2 retries, then abort: no backup, no agent */
#define ACCOUNT_ATTEMPTS 2      /* 1 retry, then terminate */
#define FIREWALL_ATTEMPTS 2     /* 1 retry, then abort before spawn */
#define SPAWN_ATTEMPTS 2        /* 1 retry when the cell's start fails, then abort, keeping the backup */
#define TELEMETRY_ATTEMPTS 4    /* 3 reconnects, then lost sight of the cell is a violation */

#ifdef REVERT_UID_NONUNIQUE
#define REVERT_UID_UNLOCKED     /* the range's uniqueness left to what _free_uid sees, and -o */
#endif

/* The graph's nodes, as build_graph adds them; tests/test_model.py checks this list against the graph's
   nodes and against the kill@NODE points of the fault-injection hook (session/nodes/kit.py crash()). */
mtype:node = { plan, policy, preflight, abort, account, firewall, spawn, monitor, terminate, cleanup, audit };

/* The audit trail's records (event session.X). */
mtype:rec = { r_none, r_plan, r_policy, r_preflight, r_abort, r_account, r_firewall, r_spawn, r_tick, r_escape,
              r_exit, r_timeout, r_terminate, r_cleanup, r_end };

/* The cell host's answer to spawn. */
mtype:answer = { started, failed };

#define NOSTATUS   0
#define RUNNING    1
#define COMPLETED  2
#define TERMINATED 3
#define ABORTED    4
#define FINAL(st)  (st >= COMPLETED)

#define NOAGENT 0
#define ALIVE   1       /* the agent's processes run */
#define FROZEN  2       /* its cgroup is frozen: nothing of it runs */

/* ---- what exists on the host ---------------------------------------------------------------------------- */
bool backup[N];         /* the preflight backup (kept after the session: restore needs it) */
bool rec[N];            /* <state>/ephemeral/ac-sXXXX: the account's record, written before the account */
byte uid[N];            /* the uid that record names */
bool grp[N];            /* the account's group (gid = uid) */
bool usr[N];            /* the account */
bool grant[N];          /* its ACL grants on the declared paths */
bool fw[N];             /* the nftables table of the cell (and its record in /run/agentcell/nft) */
bool cg[N];             /* the cell's cgroup */
bool mon[N];            /* the escape monitor's sources, open in the cell host */
byte agent[N];          /* NOAGENT, ALIVE, FROZEN */
bool verdict[N];        /* the monitor ended the cell at an escape */

/* ---- processes -------------------------------------------------------------------------------------------- */
bool sup[N];            /* the session's supervisor (session start) is alive */
byte hosts[N];          /* cell hosts of the session alive */
bool hostdied[N];       /* the supervisor's cell host was killed (its connection ended without the cell's end) */
bool hostlock[N];       /* the cell host's flock on <run dir>/hosts/CELL_ID, held for its life */
bool term_req[N];       /* the supervisor asked its cell host to end the cell (cell.terminate) */
bool owner_alive[N];    /* the process the checkpoint names as the session's supervisor is alive */
bool recovering;        /* a recover runs (one at a time) */
chan answers[N] = [2] of { mtype:answer };

/* ---- the checkpoint (LangGraph's SqliteSaver): what recover knows ------------------------------------------ */
mtype:node ck_at[N];    /* the last node checkpointed */
byte ck_status[N];
bool ck_acct[N];        /* an account is recorded (state "account") */
bool ck_grants[N];      /* its grants are recorded (state "grants") */
bool ck_fw[N];          /* the table is recorded (state "firewall_table") */
bool ck_escape[N];      /* the verdict is recorded (state "escape") */
bool ck_done[N];        /* the audit node ran: nothing left to recover */

/* ---- the audit trail --------------------------------------------------------------------------------------- */
mtype:rec last[N];      /* the session's last record in the trail */
byte end_status[N];     /* what its session.end record says */
bool end_escape[N];
bool torn;              /* a writer died between its record and the anchor (<log>.head) */
bool refused[N];        /* ghost: the disk refused one of the session's records (the environment, not a bug) */

/* ---- the uid range: one lock around the pick, the record and useradd (accounts/ephemeral.py) ------------------ */
byte uidlock = NOUID;   /* the session holding it (flock: released when its holder dies) */

/* ---- the monitor's host programs (monitor/hostprog.py): instances 0..K-1 of the programs and their maps ---- */
byte refs[K];           /* the kernel's count: processes holding copies of the instance's fds */
bool att[K];            /* its programs attached (the kernel detaches them when the last holder closes) */
byte reg[H];            /* calls.json: the instance holder p recorded (its fds and their ids), NONE: no entry */
bool dead[H];           /* ... and that holder is dead (an entry left by a SIGKILL; dropped at the next write) */
byte ring[N];           /* the instance whose maps hold the cell's rings (cgroup id -> ring), NONE: none */

byte crashes = CRASHES;
byte faults = FAULTS;
byte refusals = REFUSALS;

/* ---- the properties --------------------------------------------------------------------------------------- */
#define each(P) (P(0) && (N < 2 || P(1)) && (N < 3 || P(2)))

#define needs_backup(s)  (agent[s] == NOAGENT || backup[s])
#define needs_rule(s)    (agent[s] == NOAGENT || fw[s])
#define needs_mon(s)     (agent[s] == NOAGENT || mon[s])
#define watched(s)       (agent[s] == NOAGENT || (ring[s] != NONE && att[ring[s]]))
#define after_verdict(s) (!verdict[s] || agent[s] != ALIVE)
#define nothing_left(s)  (!ck_done[s] || (!usr[s] && !grp[s] && !rec[s] && !grant[s] && !fw[s] && !cg[s] \
                          && agent[s] == NOAGENT))
#define trail_says(s)    (!ck_done[s] || refused[s] || \
                          (last[s] == r_end && end_status[s] == ck_status[s] && end_escape[s] == ck_escape[s]))
#define live(s)          (usr[s] || grp[s])
#define own_uid(s)       (N < 2 || !live(s) || ((s == 0 || !live(0) || uid[0] != uid[s]) && \
                          (s == 1 || !live(1) || uid[1] != uid[s]) && (N < 3 || s == 2 || !live(2) || uid[2] != uid[s])))
#define clean(s)         (ck_done[s] && !usr[s] && !grp[s] && !rec[s] && !grant[s] && !fw[s] && !cg[s] && \
                          agent[s] == NOAGENT && !mon[s] && hosts[s] == 0 && !sup[s])
/* nobody holds the host programs: detached, their maps (and every ring in them) gone */
#define no_holder        (refs[0] == 0 && (K < 2 || refs[1] == 0) && (K < 3 || refs[2] == 0) && (K < 4 || refs[3] == 0) \
                          && (K < 5 || refs[4] == 0) && (K < 6 || refs[5] == 0) && (K < 7 || refs[6] == 0))

ltl AgentNeedsBackup { [] each(needs_backup) }
ltl AgentNeedsNetRule { [] each(needs_rule) }
ltl AgentNeedsMonitor { [] each(needs_mon) }
ltl AgentWatchedByPrograms { [] each(watched) }
ltl NoAgentAfterVerdict { [] each(after_verdict) }
ltl CleanMeansNothingLeft { [] each(nothing_left) }
ltl AuditDescribesState { [] each(trail_says) }
ltl UniqueUids { [] each(own_uid) }
ltl TeardownReachable { <> (each(clean) && no_holder) }

/* ---- who holds a uid ------------------------------------------------------------------------------------ */
#define other_has_uid(s) ((s != 0 && usr[0] && uid[0] == uid[s]) || (N > 1 && s != 1 && usr[1] && uid[1] == uid[s]) \
                          || (N > 2 && s != 2 && usr[2] && uid[2] == uid[s]))
/* a uid another session holds: by its group or account (what useradd looks at) */
#define held(u, s)  ((s != 0 && uid[0] == u && (grp[0] || usr[0])) || (N > 1 && s != 1 && uid[1] == u && \
                     (grp[1] || usr[1])) || (N > 2 && s != 2 && uid[2] == u && (grp[2] || usr[2])))
/* ... or names in its record, still there from a session that crashed before its useradd */
#define recorded(u, s)  ((s != 0 && rec[0] && uid[0] == u) || (N > 1 && s != 1 && rec[1] && uid[1] == u) || \
                         (N > 2 && s != 2 && rec[2] && uid[2] == u))
#ifdef REVERT_UID_UNLOCKED
#define taken(u, s) held(u, s)
#else
#define taken(u, s) (held(u, s) || recorded(u, s))
#endif
#define usr_taken(u, s) ((s != 0 && usr[0] && uid[0] == u) || (N > 1 && s != 1 && usr[1] && uid[1] == u) || \
                         (N > 2 && s != 2 && usr[2] && uid[2] == u))
#define grp_taken(u, s) ((s != 0 && grp[0] && uid[0] == u) || (N > 1 && s != 1 && grp[1] && uid[1] == u) || \
                         (N > 2 && s != 2 && grp[2] && uid[2] == u))

/* ---- crashes ------------------------------------------------------------------------------------------------
   A process may be killed (SIGKILL) before any of its steps: CRASH opens each step (each `atomic` below is one
   step: other processes interleave between steps, not within one). */

#define CRASH     if :: atomic { crashes > 0 -> crashes-- }; goto died :: true -> skip fi
#define OR_CRASH  :: atomic { crashes > 0 -> crashes-- }; goto died   /* (while it waits) */

/* A cell host killed: its cell's PID 1 dies with it (PR_SET_PDEATHSIG, then the PID namespace), and so does
   the monitor; the cgroup and the adopted table stay for cleanup; its flock goes with it, and so do its copies
   of the host programs' fds (its entry in calls.json stays, a dead pid's); its rings stay in their maps. */
#define HOST_CRASH  if :: atomic { crashes > 0 -> crashes-- }; agent[s] = NOAGENT; mon[s] = false; hostdied[s] = true; \
                                         hostlock[s] = false; hosts[s]--; killed(p, hp); goto fin \
                       :: true -> skip fi

/* ---- the host programs (monitor/hostprog.py acquire and release) -------------------------------------------- */

/* A holder's copies of instance k's fds closed (release, or the kernel at its death): the last holder's close
   detaches the programs and frees their maps (every ring in them goes). */
inline close_fds(k) {
  refs[k]--;
  if
  :: refs[k] == 0 ->
     att[k] = false;
     j = 0;
     do
     :: j < N -> if :: ring[j] == k -> ring[j] = NONE :: else -> skip fi; j++
     :: else -> break
     od;
     j = 0
  :: else -> skip
  fi
}

/* hostprog.release, its end: the process's fds closed (HostPrograms.close) */
inline release_fds(k) {
#ifdef REVERT_RELEASE_DETACHES
  att[k] = false;               /* the links detached (BPF_LINK_DETACH) by whichever user lets go, not the last */
#endif
  close_fds(k)
}

/* SIGKILL of holder p (holding instance hp, or NONE): its fds closed by the kernel; its entry, if any, stays. */
inline killed(p, hp) {
  if :: reg[p] != NONE -> dead[p] = true :: else -> skip fi;
  if :: hp != NONE -> close_fds(hp); hp = NONE :: else -> skip fi
}

/* an entry of calls.json that acquire joins: another holder's, alive (_alive, and _take: its pid the process
   that started then, each fd the object it recorded) */
#define live_entry(q, p) (q < H && q != p && reg[q] != NONE && !dead[q])

/* acquire (_join_or_create), all of it under calls.lock in one step: a holder killed meanwhile leaves nothing
   (the list is written at the end, by a rename; its fds go with it). The first live holder's instance is
   joined (copies of its fds, pidfd_getfd); none: the programs loaded and attached anew. The list written back
   without the dead holders' entries, with this one's. */
inline acquire(p, hp) {
  if
  :: live_entry(0, p) -> hp = reg[0]
  :: live_entry(1, p) -> hp = reg[1]
  :: live_entry(2, p) -> hp = reg[2]
  :: live_entry(3, p) -> hp = reg[3]
  :: live_entry(4, p) -> hp = reg[4]
  :: live_entry(5, p) -> hp = reg[5]
  :: live_entry(6, p) -> hp = reg[6]
  :: else -> hp = NONE
  fi;
  if
  :: hp != NONE -> refs[hp]++
  :: else ->
     k = 0;
     do
     :: k < K && refs[k] > 0 -> k++
     :: else -> break
     od;
     assert(k < K);             /* (K is enough) */
     hp = k; refs[k] = 1; att[k] = true; k = 0
  fi;
  j = 0;
  do
  :: j < H -> if :: dead[j] -> reg[j] = NONE; dead[j] = false :: else -> skip fi; j++
  :: else -> break
  od;
  j = 0;
  reg[p] = hp
}

/* The warm launcher killed: its fds closed by the kernel, its entry left. */
#define LAUNCHER_CRASH  if :: atomic { crashes > 0 -> crashes-- }; killed(LH, lp); goto died :: true -> skip fi

/* ---- the audit trail (AuditLog.append) --------------------------------------------------------------------- */

/* One record, under the log's flock. A writer killed between its record and the anchor (<log>.head) leaves
   the anchor one record behind: the next writer moves it on (6a11407), then appends. `ok`: the record is in
   the trail. */
inline append(s, kind) {
  atomic {
    CRASH;
    ok = true;
    if
    :: torn ->
#ifdef REVERT_TORN_ANCHOR_REFUSED
       ok = false               /* "it does not end where its anchor says": every later record refused */
#else
       torn = false
#endif
    :: else -> skip
    fi;
    if
    :: ok && refusals > 0 -> refusals--; ok = false; refused[s] = true
    :: ok -> last[s] = kind
    :: else -> skip
    fi;
    if
    :: atomic { ok && crashes > 0 -> crashes-- }; torn = true; goto died   /* killed before its anchor */
    :: true -> skip
    fi
  }
}

/* ---- the teardown nodes (nodes/teardown.py), shared by the supervisor and recover ---------------------------
   `hdl`: this process holds the cell's handle (the supervisor whose spawn succeeded); `fwmem`: it holds the
   table it made and has not handed over (Runtime.firewalls). They never raise: a record the trail refuses is
   kept in the state (audit_quietly). */

inline terminate_node(s) {
  if
  :: hdl ->                         /* cell.terminate, then cell.wait: its host freezes, kills, takes down, exits */
     atomic { CRASH; term_req[s] = true };
     if
     :: hosts[s] == 0 -> skip
     OR_CRASH
     fi;
     hdl = false
  :: else ->                        /* no handle (recover, or no cell): the cell's cgroup by its name */
#ifndef REVERT_HOST_UNLOCKED
     if
     :: !hostlock[s] -> skip        /* the cell host's lock: none of the session's can be starting or running */
     OR_CRASH
     fi;
#endif
     atomic { CRASH; if :: cg[s] -> agent[s] = NOAGENT :: else -> skip fi }   /* kill_by_name: freeze, kill */
  fi;
  append(s, r_terminate);
  atomic { CRASH; if :: !FINAL(ck_status[s]) -> ck_status[s] = TERMINATED :: else -> skip fi; ck_at[s] = terminate }
}

inline cleanup_node(s) {
  /* the table: the one this process still holds, else the checkpoint's, else the one named after the cell
     (firewall.table_name: a supervisor killed between making it and checkpointing it) */
  atomic {
    CRASH;
#ifdef REVERT_TABLE_BY_STATE_ONLY
    if :: fwmem || ck_fw[s] -> fw[s] = false :: else -> skip fi;
#else
    fw[s] = false;
#endif
    fwmem = false
  };
  /* the account: the checkpoint's, else the one its record names (ephemeral_left) */
  if
  :: ck_acct[s] || rec[s] ->
     /* _given_in_revoke: vouched for (its uid its own), its processes killed first */
     atomic { CRASH; if :: !usr[s] && usr_taken(uid[s], s) -> skip :: else -> kill_uid(s) fi };
     atomic {
       CRASH;
#ifdef REVERT_REVOKE_RECORDED_ONLY
       if :: ck_grants[s] -> grant[s] = false :: else -> skip fi   /* the recorded grants only */
#else
       grant[s] = false             /* the recorded grants; none recorded (killed while granting): every declared path */
#endif
     };
     delete_account(s)
  :: else -> skip
  fi;
  atomic { CRASH; agent[s] = NOAGENT; cg[s] = false };   /* cgroups.remove_by_name */
  append(s, r_cleanup);
  atomic { CRASH; ck_at[s] = cleanup }
}

/* kill -1 as the uid: every process of the uid, whichever session's */
inline kill_uid(s) {
  j = 0;
  do
  :: j < N -> if :: uid[j] == uid[s] -> agent[j] = NOAGENT :: else -> skip fi; j++
  :: else -> break
  od
}

/* ephemeral.delete: an account of this module's only, and only while its uid is its own: every process of the
   uid (kill -1 as the uid), the user, the group, then the record. */
inline delete_account(s) {
  if
  :: atomic { !usr[s] && usr_taken(uid[s], s) -> skip }   /* vouch: "uid now belongs to ...: left alone" */
  :: else ->
     atomic { CRASH; kill_uid(s) };
     atomic { CRASH; usr[s] = false };
     atomic { CRASH; grp[s] = false };
     atomic { CRASH; rec[s] = false }
  fi
}

inline audit_node(s) {
  append(s, r_end);
  if :: ok -> end_status[s] = ck_status[s]; end_escape[s] = ck_escape[s] :: else -> skip fi;
  atomic { CRASH; ck_done[s] = true; ck_at[s] = audit }
}

/* ---- the cell host (host/server.py run_once; supervise.py Supervised.start and finish) --------------------- */

/* the cell's rings into the maps of the instance it holds (map_update, NOEXIST), then _sweep */
inline ring_in(s, hp) {
  ring[s] = hp;
  j = 0;
  do
  :: j < N -> if :: j != s && ring[j] == hp && !cg[j] -> ring[j] = NONE :: else -> skip fi; j++
  :: else -> break
  od;
  j = 0
}

proctype host(byte s; byte p) {   /* p: its holder number (its pid, for the host programs) */
  byte hp = NONE, j, k;             /* hp: the instance of the host programs it holds */
  atomic {
    HOST_CRASH;
#ifndef REVERT_HOST_UNLOCKED
    /* its lock, then its client: a supervisor already gone is refused (recover may be tearing the session
       down); one that goes later finds this process in its way (recover waits for the lock) */
    !hostlock[s] -> hostlock[s] = true;
    if :: !sup[s] -> answers[s]!failed; hostlock[s] = false; hosts[s]--; goto fin :: else -> skip fi;
#endif
#ifndef REVERT_ADOPT_UNCHECKED
    /* "fail closed: never a cell without its rule": the table handed over must exist */
    if :: !fw[s] -> answers[s]!failed; hostlock[s] = false; hosts[s]--; goto fin :: else -> skip fi;
#endif
    skip
  };
  atomic { HOST_CRASH; mon[s] = true };      /* the monitor's sources, open before the command can run */
  atomic { HOST_CRASH; cg[s] = true };       /* launch.prepare: the cell's cgroup */
  /* watch_calls (FailedCalls.__init__): the host programs held, then the cell's rings in their maps, then the
     rings of cells whose cgroup is gone swept out (_sweep: their monitor was killed) */
  atomic { HOST_CRASH; acquire(p, hp) };
#ifndef REVERT_RING_AFTER_START
  atomic { HOST_CRASH; ring_in(s, hp) };
#endif
  atomic { HOST_CRASH; agent[s] = ALIVE };   /* prepared.go: the agent runs */
#ifdef REVERT_RING_AFTER_START
  atomic { HOST_CRASH; ring_in(s, hp) };     /* the rings added once the command has started */
#endif
  atomic {
    HOST_CRASH;
    if
    :: faults > 0 ->                /* the monitor fails to attach, after the cell started */
       faults--;
#ifdef REVERT_MONITOR_FAIL_KEEPS_CELL
       mon[s] = false; answers[s]!failed; goto serve   /* (before 1e2ae42) the error went up, the cell stayed */
#else
       agent[s] = NOAGENT; mon[s] = false; cg[s] = false; fw[s] = false;   /* finish: taken down whole */
       answers[s]!failed; goto settle
#endif
    :: true -> answers[s]!started
    fi
  };
serve:
  do
  :: atomic { agent[s] == ALIVE ->  /* an escape attempt: the monitor's verdict freezes the cell */
#ifdef REVERT_KILL_WITHOUT_FREEZE
       verdict[s] = true            /* the verdict first; the cell killed member by member, later */
#else
       verdict[s] = true; agent[s] = FROZEN   /* one write to cgroup.freeze */
#endif
     };
     atomic { HOST_CRASH; agent[s] = NOAGENT }; break
  :: atomic { agent[s] == ALIVE -> agent[s] = NOAGENT }; break   /* the command ends */
  :: atomic { agent[s] != NOAGENT && (term_req[s] || !sup[s]) -> agent[s] = FROZEN };
     atomic { HOST_CRASH; agent[s] = NOAGENT }; break   /* asked to end it, or its supervisor gone (EOF) */
  :: agent[s] == NOAGENT -> break
  od;
  atomic { HOST_CRASH; mon[s] = false };     /* finish, in reverse: the monitor, the cgroup, the table */
  atomic { HOST_CRASH; cg[s] = false };
  atomic { HOST_CRASH; fw[s] = false };
settle:
  /* FailedCalls.close's thread, which the process waits for before it exits (calls.settle): the rings out of
     the maps, then hostprog.release: its entry off the list (under the lock), then its fds closed */
  atomic { HOST_CRASH; if :: ring[s] == hp -> ring[s] = NONE :: else -> skip fi };
  atomic { HOST_CRASH; reg[p] = NONE };
  atomic { HOST_CRASH; release_fds(hp); hp = NONE; hostlock[s] = false; hosts[s]-- };   /* and the process ends */
fin:
  skip
}

/* ---- the supervisor: `agentcell session start`, the graph from plan to audit ------------------------------ */

proctype supervisor(byte s) {
  byte tries, ticks, j, u;
  bool ok, hdl, fwmem;
  mtype:answer a;

  /* plan, policy: pure; each its record and its checkpoint. An unwritable trail sends every node with an
     error handler to terminate. */
  append(s, r_plan);
  if :: !ok -> goto err_terminate :: else -> skip fi;
  atomic { CRASH; ck_status[s] = RUNNING; ck_at[s] = plan };
  append(s, r_policy);
  if :: !ok -> goto err_terminate :: else -> skip fi;
  atomic { CRASH; ck_at[s] = policy };

  /* preflight: 2 retries, then abort (no backup, no agent) */
pf_try:
  atomic {
    CRASH;
    if
    :: faults > 0 -> faults--; tries++;
       if
       :: tries < PREFLIGHT_ATTEMPTS -> goto pf_try
#ifdef REVERT_PREFLIGHT_FAIL_OPEN
       :: else -> goto account_n    /* a failed backup does not stop the session */
#else
       :: else -> goto err_abort
#endif
       fi
    :: true -> backup[s] = true
    fi
  };
  append(s, r_preflight);
  if :: !ok -> goto err_terminate :: else -> skip fi;
  atomic { CRASH; ck_at[s] = preflight };

account_n:                          /* account: 1 retry, then terminate */
  tries = 0;
acct_try:
  /* create_ephemeral: under the range's lock, a uid that passwd, group and every record leave free, the
     record (before the account), useradd */
#ifndef REVERT_UID_UNLOCKED
  atomic { uidlock == NOUID -> uidlock = s };
#endif
  atomic {
    CRASH;
    if
    :: !taken(0, s) -> u = 0
    :: U > 1 && !taken(1, s) -> u = 1
    :: U > 2 && !taken(2, s) -> u = 2
    :: else -> u = U
    fi;
    if
    :: u == U -> goto acct_failed   /* "no free uid found" */
    :: else -> skip
    fi;
#ifdef REVERT_RECORD_AFTER_CREATE
    uid[s] = u
#else
    if
    :: rec[s] -> goto acct_failed   /* "session already has an account" */
    :: else -> rec[s] = true; uid[s] = u
    fi
#endif
  };
  atomic {
    CRASH;
#ifdef REVERT_UID_NONUNIQUE
    grp[s] = true; usr[s] = true    /* useradd --non-unique */
#else
    /* useradd --user-group, user and group at once under shadow's lock: a uid in use is refused, and a group
       given another gid than the uid is checked and undone (the same for the model: nothing of it stays) */
    if
    :: !usr_taken(u, s) && !grp_taken(u, s) -> grp[s] = true; usr[s] = true
    :: else -> goto undo_account
    fi
#endif
  };
#ifdef REVERT_RECORD_AFTER_CREATE
  atomic { CRASH; rec[s] = true };  /* recorded once it exists */
#endif
  atomic {
    CRASH;
    if :: uidlock == s -> uidlock = NOUID :: else -> skip fi;
    grant[s] = true;                /* acl.grant, path by path */
    if
    :: faults > 0 -> faults--; goto undo_grant   /* a grant fails: undone here, so that the retry starts clean */
    :: true -> skip
    fi
  };
  append(s, r_account);
  if :: !ok -> goto err_terminate :: else -> skip fi;
  atomic { CRASH; ck_acct[s] = true; ck_grants[s] = true; ck_at[s] = account };
  goto firewall_n;
undo_grant:
  atomic { CRASH; grant[s] = false };
undo_account:
  if :: uidlock == s -> uidlock = NOUID :: else -> skip fi;
  delete_account(s);
acct_failed:
  atomic {
    if :: uidlock == s -> uidlock = NOUID :: else -> skip fi;
    tries++;
    if :: tries < ACCOUNT_ATTEMPTS -> goto acct_try :: else -> goto err_terminate fi
  };

firewall_n:                         /* firewall: 1 retry, then abort before spawn */
  tries = 0;
fw_try:
  atomic {
    CRASH;
    if
    :: faults > 0 -> faults--; tries++;
       if :: tries < FIREWALL_ATTEMPTS -> goto fw_try :: else -> goto err_abort fi
    :: true -> fw[s] = true; fwmem = true   /* HostFirewall.create (its record first) */
    fi
  };
  append(s, r_firewall);
  if :: !ok -> goto err_terminate :: else -> skip fi;
  atomic { CRASH; ck_fw[s] = true; ck_at[s] = firewall };

  /* spawn: 1 retry when the cell's start fails, then abort, keeping the backup */
  tries = 0;
sp_try:
  atomic { CRASH; hostdied[s] = false; hosts[s]++; run host(s, SPAWN_ATTEMPTS * s + tries) };   /* a cell host of its own, the table handed over */
  if
  :: answers[s]?a
  :: atomic { hostdied[s] && empty(answers[s]) -> a = failed }     /* it died before it answered */
  OR_CRASH
  fi;
  if
  :: a == failed -> tries++;
     if :: tries < SPAWN_ATTEMPTS -> goto sp_try :: else -> goto err_abort fi
  :: else -> hdl = true; fwmem = false   /* the host owns the table now */
  fi;
  append(s, r_spawn);
  if :: !ok -> goto err_terminate :: else -> skip fi;
  atomic { CRASH; ck_at[s] = spawn };

  /* monitor: one watch per step; a lost cell retried 3 times, then a violation */
  tries = 0;
mon_try:
  if
  :: verdict[s] ->                  /* the first escape: the session's verdict, even unrecorded */
     append(s, r_escape);
     atomic { CRASH; ck_status[s] = TERMINATED; ck_escape[s] = true; ck_at[s] = monitor };
     goto terminate_n
  :: !verdict[s] && hosts[s] == 0 && !hostdied[s] ->   /* the cell ended: its result */
     append(s, r_exit);
     if :: !ok -> goto err_terminate :: else -> skip fi;
     atomic { CRASH; ck_status[s] = COMPLETED; ck_at[s] = monitor };
     goto terminate_n
  :: !verdict[s] && hostdied[s] -> goto telemetry_lost   /* its host ended without a word */
  :: atomic { faults > 0 -> faults-- }; goto telemetry_lost   /* the monitor's stream lost */
  :: agent[s] != NOAGENT && ticks < TICKS ->   /* a tick: the proof the trail still takes records */
     append(s, r_tick);
     if :: !ok -> goto err_terminate :: else -> skip fi;
     atomic { CRASH; ck_at[s] = monitor; ticks++ };
     goto mon_try
  :: agent[s] != NOAGENT && ticks == TICKS ->  /* the wall clock */
     append(s, r_timeout);
     if :: !ok -> goto err_terminate :: else -> skip fi;
     atomic { CRASH; ck_status[s] = COMPLETED; ck_at[s] = monitor };
     goto terminate_n
  OR_CRASH
  fi;
telemetry_lost:
  tries++;
  if
  :: tries < TELEMETRY_ATTEMPTS -> goto mon_try
  :: else -> atomic { CRASH; ck_status[s] = TERMINATED; ck_escape[s] = true; ck_at[s] = monitor };
     goto terminate_n
  fi;

err_abort:                          /* an error handler's route: abort, then cleanup */
  atomic { CRASH; ck_status[s] = ABORTED; ck_at[s] = abort };
  append(s, r_abort);
  atomic { CRASH; ck_at[s] = abort };
  goto cleanup_n;

err_terminate:                      /* an error handler's route: terminate */
  atomic { CRASH; ck_status[s] = TERMINATED; ck_at[s] = monitor };

terminate_n:
  terminate_node(s);
cleanup_n:
  cleanup_node(s);
  audit_node(s);
  atomic { sup[s] = false; owner_alive[s] = false };
  goto end_sup;

died:                               /* SIGKILL: the flock on the uid range goes with the process */
  atomic { sup[s] = false; owner_alive[s] = false; if :: uidlock == s -> uidlock = NOUID :: else -> skip fi };
end_sup:
  skip
}

/* ---- agentcell session recover (graph.recover): one session, from its checkpoint alone ------------------ */

proctype recover(byte s) {
  byte j;
  bool ok, hdl, fwmem;
  /* update_state: this process is the supervisor now; status terminated unless final; next: terminate */
  atomic { CRASH; owner_alive[s] = true; if :: !FINAL(ck_status[s]) -> ck_status[s] = TERMINATED :: else -> skip fi;
           ck_at[s] = monitor };
  terminate_node(s);
  cleanup_node(s);
  audit_node(s);
  atomic { owner_alive[s] = false; recovering = false };
  goto end_rec;
died:
  atomic { owner_alive[s] = false; recovering = false };
end_rec:
  skip
}

/* ---- the warm launcher (host/zygote.py _hold_programs), as root: it holds the host programs while watched
   cells come, and lets them go 60 s after the last (at any time, for the model: a cell may outlast that). ---- */

#if LAUNCHER
proctype launcher() {
  byte lp = NONE, j, k;
  atomic { LAUNCHER_CRASH; acquire(LH, lp) };   /* calls.hold */
  atomic { LAUNCHER_CRASH; reg[LH] = NONE };    /* hostprog.release: its entry off the list */
  atomic { LAUNCHER_CRASH; release_fds(lp); lp = NONE };
died:
  skip
}
#endif

/* `agentcell session recover` runs whenever a session needs it: not finished, its supervisor gone
   (graph.unfinished); one at a time. */
#ifdef REVERT_RECOVER_BY_STATUS
#define unfinished(s) (!FINAL(ck_status[s]) && !ck_done[s] && !owner_alive[s])   /* by its status, not its end */
#else
#define unfinished(s) (!ck_done[s] && !owner_alive[s])
#endif

proctype operator() {
end:
  do
  :: atomic { !recovering && unfinished(0) -> recovering = true; run recover(0) }
#if N > 1
  :: atomic { !recovering && unfinished(1) -> recovering = true; run recover(1) }
#endif
#if N > 2
  :: atomic { !recovering && unfinished(2) -> recovering = true; run recover(2) }
#endif
  od
}

init {
  byte s;
  atomic {
    do
    :: s < N -> uid[s] = NOUID; last[s] = r_none; ck_at[s] = plan; ring[s] = NONE;
                sup[s] = true; owner_alive[s] = true;   /* graph.run: the first checkpoint names it */
                run supervisor(s); s++
    :: else -> break
    od;
    s = 0;
    do
    :: s < H -> reg[s] = NONE; s++   /* calls.json: no holder */
    :: else -> break
    od;
    s = 0;
    run operator();
#if LAUNCHER
    run launcher();
#endif
    skip
  }
}

/* Every safety property above in one search ([] (a && b) is [] a && [] b): the test suite checks this one, then
   each alone only if it fails, to name which. A never claim (the formula as an ltl line is longer than spin's
   LTL translator takes): it ends, a violation, at the first state where one of them does not hold. It stands
   last: a claim before the processes are declared checks nothing. */
#define all_safe (each(needs_backup) && each(needs_rule) && each(needs_mon) && each(watched) && \
                  each(after_verdict) && each(nothing_left) && each(trail_says) && each(own_uid))
never AllSafety {
    do
    :: all_safe
    :: !(all_safe) -> break
    od
}
