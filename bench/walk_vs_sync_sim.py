"""Protocol simulator for chunk_walk_vs (linattn, sm90) mbarrier / named-barrier sync: a
hand model of generated/sm90/gdn/chunk_walk_vs.py at 0790e4e (update it with the kernel).

Actors are warps (state groups 0/1: 4 warps each, aux: 4 warps, loads: warp 0 of WG3;
warps 1..3 of WG3 exit at once).  Every warp of a group executes its group's program
(barrier arrivals are 32 per warp, so a warpgroup's 128-thread arrive = 4 warp events).
mbarrier semantics: a barrier of count N completes its current phase when N arrivals
happened; the phase counter k = number of completed phases; wait(parity p) passes iff
p != k % 2 (so wait(1) passes on a fresh barrier).  bar.sync(id, n): n/32 warps arrive,
each waits for that generation to complete.

Checks:
  deadlock   - no actor can move and some have not finished
  alias      - a wait passes while the barrier is not at the phase the program means
               (intended phase i: pass must happen with k == i + 1; k == i + 3 etc. is a
               parity alias; k == i + 2 would block forever -> deadlock)
  overflow   - more arrivals land in a phase than the program means (an arrival meant
               for phase i lands in phase j != i)
  race       - vector-clock happens-before: two accesses to the same buffer slot by
               different groups, at least one a write, unordered by barriers
Exploration: exhaustive DFS over interleavings with state dedup (small n), plus random
and priority (one actor runs as far ahead as it can) schedules for larger n.
Mutations (bugs planted on purpose) check that the checker catches what it should.
"""
import itertools, random, sys
from collections import defaultdict

WG = 128
STAGES, SLOTS = 3, 2


def make_config(**kw):
    cfg = dict(STAGES=3, SLOTS=2, full_cnt=32, empty_cnt=3 * WG, afull_cnt=WG,
               afree_cnt=2 * WG,
               prod_empty_par=lambda c, S: (c // S + 1) % 2,
               cons_full_par=lambda c, S: (c // S) % 2,
               state_afull_par=lambda c, L: (c // L) % 2,
               aux_afree_par=lambda c, L: (c // L + 1) % 2,
               aux_arrives_empty=True, aux_waits_afree=True, state_arrive_before_read=False,
               aux_named_syncs=3, coarse=False)
    cfg.update(kw)
    return cfg


def programs(n_chunks, cfg):
    """Per-actor event lists.  Events:
       ('wait', bar, idx, parity, intended_phase)
       ('arrive', bar, idx, count, intended_phase)
       ('read'|'write', buf, idx)
       ('bsync', name, nwarps)  named barrier (arrive + wait its generation)"""
    S, L = cfg["STAGES"], cfg["SLOTS"]
    progs = {}
    # state groups
    for r in (0, 1):
        ev = []
        for c in range(n_chunks):
            ld, st = c % S, c % L
            ev.append(('wait', 'full', ld, cfg["cons_full_par"](c, S), c // S))
            ev += [('read', 'q_s', ld), ('read', 'k_s', ld)]            # SK, O wgmma
            ev.append(('wait', 'a_full', st, cfg["state_afull_par"](c, L), c // L))
            ev += [('read', 'eg_s', st), ('read', 'v_s', ld), ('read', 'a_s', st),
                   ('read', 'eo_s', st), ('read', 'er_s', st)]
            tail = [('read', 'p_s', st), ('read', 'k_s', ld)]           # O += Vd P^T, S +=
            arr = [('arrive', 'empty', ld, 32, c // S), ('arrive', 'a_free', st, 32, c // L)]
            ev += (arr + tail) if cfg["state_arrive_before_read"] else (tail + arr)
            ev += [('write', f'o_s{r}', 0), ('read', f'o_s{r}', 0)]
        for w in range(1 if cfg["coarse"] else 4):
            progs[f'S{r}w{w}'] = [coarsen(e, cfg) for e in ev]
    # aux
    ev = []
    for c in range(n_chunks):
        ld, st = c % S, c % L
        for k in range(cfg["aux_named_syncs"]):
            ev.append(('bsync', 'AUX', 4))
        ev.append(('wait', 'full', ld, cfg["cons_full_par"](c, S), c // S))
        if cfg["aux_waits_afree"]:
            ev.append(('wait', 'a_free', st, cfg["aux_afree_par"](c, L), c // L - 1))
        ev += [('write', 'eg_s', st), ('write', 'eo_s', st), ('write', 'er_s', st),
               ('read', 'q_s', ld), ('read', 'k_s', ld), ('write', 'p_s', st),
               ('read', 'k_s', ld)]
        if cfg["aux_arrives_empty"]:
            ev.append(('arrive', 'empty', ld, 32, c // S))
        ev += [('bsync', 'AUX', 4)] * 3          # inverse passes (representative)
        ev += [('write', 'a_s', st), ('arrive', 'a_full', st, 32, c // L)]
    for w in range(1 if cfg["coarse"] else 4):
        progs[f'AUXw{w}'] = [coarsen(e, cfg) for e in ev]
    # loads: warp 0 only
    ev = []
    for c in range(n_chunks):
        ld = c % S
        ev.append(('wait', 'empty', ld, cfg["prod_empty_par"](c, S), c // S - 1))
        ev += [('write', 'q_s', ld), ('write', 'k_s', ld), ('write', 'v_s', ld)]
        ev.append(('arrive', 'full', ld, 32, c // S))
    progs['LDw0'] = ev
    if not cfg["coarse"]:
        for w in (1, 2, 3):
            progs[f'LDw{w}'] = []
    return progs


def coarsen(e, cfg):
    if not cfg["coarse"]:
        return e
    if e[0] == 'arrive':
        return e[:3] + (128,) + e[4:]
    if e[0] == 'bsync':
        return ('bsync', e[1], 1)
    return e


def group_of(actor):
    return actor[:-2]


class Sim:
    def __init__(self, n_chunks, cfg):
        self.cfg = cfg
        self.progs = programs(n_chunks, cfg)
        self.actors = sorted(self.progs)
        self.pc = {a: 0 for a in self.actors}
        S, L = cfg["STAGES"], cfg["SLOTS"]
        self.count = {}
        for i in range(S):
            self.count[('full', i)] = cfg["full_cnt"]
            self.count[('empty', i)] = cfg["empty_cnt"]
        for i in range(L):
            self.count[('a_full', i)] = cfg["afull_cnt"]
            self.count[('a_free', i)] = cfg["afree_cnt"]
        self.count[('AUX', 0)] = 1 if cfg["coarse"] else 4
        self.phase = defaultdict(int)        # completed phases
        self.pending = defaultdict(int)      # arrivals in current phase
        self.pending_int = defaultdict(set)  # intended phases of arrivals in current phase
        self.phase_vc = {}                   # (bar, idx, k) -> vc joined at completion
        self.pend_vc = defaultdict(dict)
        self.vc = {a: defaultdict(int) for a in self.actors}
        self.bsync_gen = defaultdict(int)    # per actor: generations passed
        self.bsync_arrived = {}              # actor -> generation it arrived for, awaiting
        self.acc = defaultdict(lambda: {'w': None, 'r': {}})
        self.errors = []

    # --- vector clocks
    def tick(self, a):
        self.vc[a][a] += 1
        return self.vc[a][a]

    def join(self, a, other):
        for k, v in other.items():
            if v > self.vc[a][k]:
                self.vc[a][k] = v

    def hb(self, ev_actor, ev_clock, a):
        return self.vc[a][ev_actor] >= ev_clock

    def access(self, a, kind, buf, idx):
        t = self.tick(a)
        rec = self.acc[(buf, idx)]
        g = group_of(a)
        w = rec['w']
        if w and group_of(w[0]) != g and not self.hb(w[0], w[1], a):
            self.errors.append(f"race: {kind} {buf}[{idx}] by {a} vs write by {w[0]} (unordered)")
        if kind == 'write':
            for ra, rc in rec['r'].items():
                if group_of(ra) != g and not self.hb(ra, rc, a):
                    self.errors.append(f"race: write {buf}[{idx}] by {a} vs read by {ra} (WAR unordered)")
            rec['w'] = (a, t)
            rec['r'] = {}
        else:
            rec['r'][a] = t

    # --- stepping
    def enabled(self, a):
        p = self.progs[a]
        if self.pc[a] >= len(p):
            return False
        e = p[self.pc[a]]
        if e[0] == 'wait':
            _, bar, idx, par, _ = e
            return par != self.phase[(bar, idx)] % 2
        if e[0] == 'bsync':
            if a in self.bsync_arrived:
                return self.phase[('AUX', 0)] > self.bsync_arrived[a]
            return True
        return True

    def arrive(self, a, key, n, intended):
        t = self.tick(a)
        self.pending[key] += n
        self.pending_int[key].add(intended)
        if intended is not None and intended != self.phase[key]:
            self.errors.append(f"overflow/misroute: {a} arrival meant for phase {intended} of "
                               f"{key} lands in phase {self.phase[key]}")
        self.pend_vc[key][a] = t
        if self.pending[key] > self.count[key]:
            self.errors.append(f"overflow: {key} phase {self.phase[key]} got {self.pending[key]} > {self.count[key]}")
        if self.pending[key] == self.count[key]:
            vc = defaultdict(int)
            for aa, tt in self.pend_vc[key].items():
                vc[aa] = max(vc[aa], tt)
            # transitive: join arrivers' full clocks at arrive time
            for aa in self.pend_vc[key]:
                pass
            self.phase_vc[(key, self.phase[key])] = self.arr_vc_acc.pop(key, vc)
            self.phase[key] += 1
            self.pending[key] = 0
            self.pending_int[key] = set()
            self.pend_vc[key] = {}

    def step(self, a):
        e = self.progs[a][self.pc[a]]
        kind = e[0]
        if kind == 'wait':
            _, bar, idx, par, intended = e
            key = (bar, idx)
            k = self.phase[key]
            if k != intended + 1:
                self.errors.append(f"alias: {a} wait {bar}[{idx}] parity {par} meant phase "
                                   f"{intended} but barrier has {k} completed phases")
            if k > 0:
                self.join(a, self.phase_vc[(key, k - 1)])
            self.tick(a)
            self.pc[a] += 1
        elif kind == 'arrive':
            _, bar, idx, n, intended = e
            key = (bar, idx)
            acc = self.arr_vc_acc.setdefault(key, defaultdict(int))
            self.tick(a)
            for kk, v in self.vc[a].items():   # release: arriver's whole clock
                acc[kk] = max(acc[kk], v)
            self.arrive(a, key, n, intended)
            self.pc[a] += 1
        elif kind == 'bsync':
            key = ('AUX', 0)
            if a not in self.bsync_arrived:
                self.bsync_arrived[a] = self.phase[key]
                acc = self.arr_vc_acc.setdefault(key, defaultdict(int))
                self.tick(a)
                for kk, v in self.vc[a].items():
                    acc[kk] = max(acc[kk], v)
                self.arrive(a, key, 1, None)
                if not self.enabled(a):
                    return
            gen = self.bsync_arrived.pop(a)
            self.join(a, self.phase_vc[(key, gen)])
            self.pc[a] += 1
        else:
            self.access(a, kind, e[1], e[2])
            self.pc[a] += 1

    def done(self):
        return all(self.pc[a] >= len(self.progs[a]) for a in self.actors)

    def state_key(self):
        return (tuple(self.pc[a] for a in self.actors),
                tuple(sorted((k, v) for k, v in self.phase.items())),
                tuple(sorted((k, v) for k, v in self.pending.items() if v)),
                tuple(sorted(self.bsync_arrived.items())))


Sim.arr_vc_acc = None


def new_sim(n, cfg):
    s = Sim(n, cfg)
    s.arr_vc_acc = {}
    return s


def run_schedule(n, cfg, chooser):
    s = new_sim(n, cfg)
    steps = 0
    while not s.done():
        en = [a for a in s.actors if s.enabled(a)]
        if not en:
            stuck = {a: s.progs[a][s.pc[a]] for a in s.actors if s.pc[a] < len(s.progs[a])}
            s.errors.append(f"deadlock: {stuck}")
            break
        s.step(chooser(en, s))
        steps += 1
    return s


def explore_exhaustive(n, cfg, limit=400000):
    """DFS over group-granular interleavings with dedup on the sync state; reports
    deadlocks and aliases (state-determined); races come from the traces."""
    import copy
    seen = set()
    errors = set()
    stack = [new_sim(n, cfg)]
    visited = 0
    while stack and visited < limit:
        s = stack.pop()
        key = s.state_key()
        if key in seen:
            continue
        seen.add(key)
        visited += 1
        if s.done():
            continue
        en = [a for a in s.actors if s.enabled(a)]
        if not en:
            errors.add("deadlock at pcs " + str({a: s.pc[a] for a in s.actors}))
            continue
        for a in en:
            t = copy.deepcopy(s)
            t.errors = []
            t.step(a)
            for e in t.errors:
                errors.add(e)
            stack.append(t)
    return errors, visited, bool(stack)


def check(cfg, label, ns=range(0, 8), seeds=30, exhaustive_upto=0, quiet=False):
    errs = set()
    schedules = 0
    for n in ns:
        # random
        for seed in range(seeds):
            rng = random.Random(seed * 1000 + n)
            s = run_schedule(n, cfg, lambda en, s: rng.choice(en))
            errs |= {f"n={n}: {e}" for e in s.errors}
            schedules += 1
        # adversarial: a priority order of groups (one runs as far ahead as it can)
        groups = ['S0', 'S1', 'AUX', 'LD']
        for order in itertools.permutations(groups):
            rank = {g: i for i, g in enumerate(order)}
            s = run_schedule(n, cfg, lambda en, s: min(en, key=lambda a: (rank[group_of(a)], a)))
            errs |= {f"n={n}: {e}" for e in s.errors}
            # warp-skewed: within each group, the last warp goes first (warps spread out)
            s = run_schedule(n, cfg, lambda en, s: min(en, key=lambda a: (rank[group_of(a)], -int(a[-1]))))
            errs |= {f"n={n}: {e}" for e in s.errors}
            schedules += 2
    exh = []
    for n in range(0, exhaustive_upto + 1):
        e, v, trunc = explore_exhaustive(n, cfg)
        errs |= {f"n={n} (exhaustive): {x}" for x in e}
        exh.append((n, v, trunc))
    if not quiet:
        print(f"== {label}: {schedules} schedules, exhaustive {exh}: "
              f"{'OK' if not errs else str(len(errs)) + ' findings'}")
        for e in sorted(errs)[:8]:
            print("   ", e[:230])
    return errs


if __name__ == "__main__":
    ex = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    base = make_config()
    e = check(base, "kernel as generated (warp actors)", ns=range(0, 10), seeds=60)
    e |= check(make_config(coarse=True), "kernel as generated (group actors, exhaustive)",
               ns=range(0, 10), seeds=60, exhaustive_upto=ex)
    print("\n-- mutations (each should be flagged) --")
    muts = {
        "empty count 2*WG (aux not counted)": dict(empty_cnt=2 * WG),
        "aux does not arrive on empty": dict(aux_arrives_empty=False),
        "a_free count WG": dict(afree_cnt=WG),
        "producer empty parity without +1": dict(prod_empty_par=lambda c, S: (c // S) % 2),
        "consumer full parity off by one": dict(cons_full_par=lambda c, S: (c // S + 1) % 2),
        "aux skips a_free wait": dict(aux_waits_afree=False),
        "state arrives empty/a_free before last reads": dict(state_arrive_before_read=True),
        "a_full parity with STAGES (c//3)": dict(state_afull_par=lambda c, L: (c // 3) % 2),
        "full count 33 (arrive + 1 expect_tx arrival)": dict(full_cnt=33),
    }
    for k, m in muts.items():
        check(make_config(**m), "MUT " + k, ns=range(0, 8), seeds=5, exhaustive_upto=0)
