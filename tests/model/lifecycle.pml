/*
 * The lifecycle of one idempotency key, for spin to explore exhaustively: claim, lease,
 * renew, complete, release, the purge at expiry, a store that forgets, and fence()'s proof
 * written in the application's own transaction.
 *
 * Actors: CALLERS callers that each send up to ATTEMPTS requests with the same key and body
 * (each request is served by a worker of its own, with a fresh token), the store, the app's
 * database, a purger, and a clock that moves on its own (abstract time, in ticks: a worker
 * that waits while the clock ticks is a worker that stalls). A store call reaches the store
 * in the tick it was sent or the next. Faults, at most FAULTS in a run: a worker crashes, a
 * store call fails (its reply lost, or never run), the handler answers 5xx after its effect,
 * the store forgets everything (a restarted Redis). A reply lost and its statement run again
 * is no fault: the store must recognise its own token.
 *
 * Three configurations: -DFENCED, the handler commits its effect with fence() and its proof
 * is a row of the app's database (engine/proofs.py: a RedisStore, a MemoryStore, a store elsewhere);
 * -DSAME_DB, fenced too, with a SQLStore on the app's own database, whose record is the proof
 * (FENCE, REFENCE, RELEASE_COMMITTED, PROBATION) and which forgets nothing; neither: the effect is
 * unfenced, and each double run is labelled with the window that let it happen.
 *
 * Each step names the code it stands for. The store's steps follow MemoryStore
 * (idempotency_mw/testing.py), the Lua scripts (stores/redis/lua/*.lua) and the SQL
 * statements (stores/sql/claims.py, statements.py): one atomic step each. The engine's steps
 * follow engine/claim.py (Call, Hold), engine/lease.py (LeaseKeeper) and http/exchange.py;
 * the proof follows engine/fence.py and engine/proofs.py (write_proof).
 *
 * Properties, each an assertion on a bit named after it (pan names the one that fails):
 *   a_one_fenced_effect   at most one committed fenced effect per key within its retention
 *   b_first_answer        a replay carries the first answer written into the record, and a
 *                         completion the store acknowledges is the one it keeps; with fence(),
 *                         that answer is the committed run's, or a later run's refusal
 *   c_lease_ends          a key never stays in progress with no live holder once its lease
 *                         ends: only the live holder extends it, and a claim after its end
 *                         takes the key over
 *   d_documented_window   an unfenced effect runs twice only in a documented window; pan
 *                         prints each window it reaches ("WINDOW name: what happened")
 *   e_lease_proven        a worker begins its effect only while the store holds its lease
 *   f_same_outcome        a statement delivered twice answers the same outcome
 *
 * Variants that must fail (tests/model/test_model.py): BROKEN_COMPLETE (complete without
 * comparing the token), BROKEN_CLAIM (a read, then a write), BROKEN_PROOF (the proof takes
 * over another run's live proof), BROKEN_RENEW (renew without comparing the token),
 * BROKEN_REDELIVERY (a claim delivered twice does not recognise its own token),
 * BROKEN_FENCE_TTL with SAME_DB (FENCE keeps the record a TTL from its claim, not its commit:
 * the code before the model found it).
 */

#ifndef CALLERS
#define CALLERS 2
#endif
#ifndef ATTEMPTS
#define ATTEMPTS 2
#endif
#ifndef FAULTS
#define FAULTS 1
#endif
#ifndef MAXT
#define MAXT 4         /* the clock stops here */
#endif
#ifdef SAME_DB
#define FENCED
#endif
#ifdef FENCED
#define FENCED_RUN 1
#else
#define FENCED_RUN 0
#endif
#define TOKENS (CALLERS * ATTEMPTS)
#define LEASE 3        /* ticks */
#define THIRD 1        /* LEASE / 3: LeaseKeeper renews every third of the lease */
#define TTL 4          /* the key's retention (ttl=) */

/* The record's status (records.RecordStatus). */
#define ABSENT 0
#define IN_PROGRESS 1
#define COMPLETED 2
#define COMMITTED 3    /* RELEASE_COMMITTED: settled as committed, without a response */

/* A claim's outcome (records.ClaimOutcome); ERROR: StoreError. */
#define ACQUIRED 1
#define REPLAY 2
#define BUSY 3
#define ERROR 4
#define COMMITTED_WITHOUT_RESPONSE 5

/* A renewal's answer (lease.Renew): False, True, None (the store failed). */
#define NOT_OWNED 0
#define OWNED_NOW 1
#define UNKNOWN 2

/* An answer is the token of the run that gave it, or REFUSED: 409 committed-without-response,
   recorded when fence() met an earlier run's proof (http/exchange.py, EffectCommitted). */
#define REFUSED (TOKENS + 1)
/* The answer when fence() found the key taken over (LeaseLost): 409 in progress, never kept. */
#define TAKEN_OVER (TOKENS + 2)

/* How the record's holder ended, as far as the windows' labels need it. */
#define RUNNING 0
#define CRASHED 1
#define UNRECORDED 2

/* Why a landed effect is no longer protected: the windows, named in WINDOWS below. */
#define PROTECTED 0
#define W_CRASHED 1
#define W_UNRECORDED 2
#define W_RELEASED 3
#define W_LAPSED 4
#define W_LATE 5
#define W_FORGOTTEN 6
#define W_RETENTION 7

c_decl {
  static unsigned windows_seen;
  static const char *WINDOWS[] = {
    "protected: none (an undocumented double run)",
    "crashed: the worker died after its effect, before its answer was recorded; its lease lapsed and a retry took the key over",
    "not-recorded: the answer could not be recorded (the store failed); the key stayed in progress until its lease lapsed, then a retry took it over",
    "released: the handler failed or answered 5xx after its effect; the key was released and a retry ran",
    "lease-lapsed: the worker lived on after its effect, but its lease was no longer proven (it stalled, or its renewals failed) and lapsed; a retry took the key over",
    "late-effect: the effect began while the lease was proven, but landed after the key was taken over (a stall between the check and the commit)",
    "forgotten: the store forgot the record (Redis restarted without persistence, a failover, an eviction) and a retry ran again",
    "retention: the record's TTL ended and a retry ran again (outside the key's retention, as designed)",
  };
}

byte clk;                                   /* the store's clock, and the workers' */
byte st, tok, lease_end, expires, answer;   /* the key's record in the store */
byte first_answer;                          /* the first answer written into this record */
bit committed_at;                           /* SAME_DB: the record's own mark of the effect */
bit probation;                              /* SAME_DB: committed_at negated (Fenced.ON_PROBATION) */
bit holder_alive;                           /* the worker of the record's token still runs */
byte holder_fate;                           /* how it ended, if it did */
byte effects;                               /* committed effects of the key */
byte faults, forgets;
#ifdef FENCED
byte ptok, pexp;                            /* the key's proof row in the app's database */
byte retained_until;                        /* the last committed effect's retention */
byte committed;                             /* the runs whose effect committed: a bit each */
#else
byte exposed;                               /* why the last landed effect lost protection */
byte window;                                /* the window of a double run, while it lands */
#endif

/* The properties: each is 1 until a step finds it broken. */
bit a_one_fenced_effect = 1;
bit b_first_answer = 1;
bit c_lease_ends = 1;
bit d_documented_window = 1;
bit e_lease_proven = 1;
bit f_same_outcome = 1;

#define FAULT (faults < FAULTS)
/* _Record.expired, EXPIRED (statements.py), a Redis key past its PEXPIRE: as good as absent. */
#define EXPIRED (st != ABSENT && expires <= clk && (st != IN_PROGRESS || lease_end <= clk))
/* _Record.owned_by, OWNED (statements.py), the token comparisons of renew.lua/release.lua. */
#define OWNED(t) (st == IN_PROGRESS && tok == (t) && !EXPIRED)

inline forget_record() {
  st = ABSENT; tok = 0; lease_end = 0; expires = 0; answer = 0; first_answer = 0;
  holder_alive = 0; holder_fate = RUNNING; committed_at = 0; probation = 0
}

/* A record that covered a landed effect is taken over or purged: the window that opens. */
inline record_goes() {
#ifndef FENCED
  if
  :: effects > 0 && exposed == PROTECTED && st == IN_PROGRESS && holder_fate == CRASHED ->
     exposed = W_CRASHED
  :: effects > 0 && exposed == PROTECTED && st == IN_PROGRESS && holder_fate == UNRECORDED ->
     exposed = W_UNRECORDED
  :: effects > 0 && exposed == PROTECTED && st == IN_PROGRESS && holder_fate == RUNNING ->
     exposed = W_LAPSED
  :: effects > 0 && exposed == PROTECTED && st == COMPLETED -> exposed = W_RETENTION
  :: else -> skip
  fi
#else
  skip
#endif
}

/* Store.claim: MemoryStore._claim; claim.lua; CLAIMS[dialect].attempt with READ and
   CAN_TAKE_OVER (sql/claims.py, statements.py). The deciding read: */
inline claim_reads(t, out) {
  if
#ifndef BROKEN_REDELIVERY
  :: st == IN_PROGRESS && tok == t -> out = ACQUIRED   /* its own token: delivered twice */
#endif
  :: else ->
     if
     :: st == ABSENT || EXPIRED || (st == IN_PROGRESS && lease_end <= clk && !committed_at) ->
        out = ACQUIRED
     :: else ->
        if
        :: st == COMPLETED -> out = REPLAY
        :: st == COMMITTED || (st == IN_PROGRESS && probation && lease_end <= clk) ->
           out = COMMITTED_WITHOUT_RESPONSE     /* READ's orphaned, or settled so */
        :: else -> out = BUSY
        fi
     fi
  fi
}

/* ... and the write that takes the key: a fresh token, lease and TTL on the store's clock. */
inline claim_writes(t) {
  if
  :: st == IN_PROGRESS && tok == t -> skip
  :: else ->
     record_goes();
     st = IN_PROGRESS; tok = t; lease_end = clk + LEASE; expires = clk + TTL;
     answer = 0; first_answer = 0; holder_alive = 1; holder_fate = RUNNING; committed_at = 0;
     probation = 0
  fi
}

inline store_claim(t, out) {
  /* PROBATION (statements.py, a claim's conditional UPDATE): a committed record whose lease
     lapsed for the first time since its holder was heard from gets one more lease, and reads
     as in progress; lapsed again, it is orphaned */
  if
  :: st == IN_PROGRESS && committed_at && !probation && lease_end <= clk && !EXPIRED ->
     lease_end = clk + LEASE; probation = 1
  :: else -> skip
  fi;
  claim_reads(t, out);
  if
  :: out == ACQUIRED -> claim_writes(t)
  :: else -> skip
  fi;
  /* c: a claim never finds the key in progress once its lease ended */
  c_lease_ends = (out != BUSY || lease_end > clk);
  assert(c_lease_ends);
  if
  :: out == REPLAY ->
     /* b: a replay carries the first answer written into the record; with fence(), that is
        the answer of a run whose effect committed, or the refusal of a later run */
#ifdef FENCED
     b_first_answer = (answer == first_answer && (answer == REFUSED || (committed >> answer) & 1));
#else
     b_first_answer = (answer == first_answer);
#endif
     assert(b_first_answer)
  :: else -> skip
  fi
}

/* Store.renew: MemoryStore.renew; renew.lua; RENEW (statements.py). */
inline store_renew(t, rv) {
  if
#ifdef BROKEN_RENEW
  :: st == IN_PROGRESS && !EXPIRED ->
#else
  :: OWNED(t) ->
#endif
     /* c: only the record's live holder keeps its lease going */
     c_lease_ends = (holder_alive && tok == t);
     assert(c_lease_ends);
     lease_end = clk + LEASE; probation = 0; rv = OWNED_NOW
  :: else -> rv = NOT_OWNED
  fi
}

/* Store.complete: MemoryStore.complete/_change; complete.lua; COMPLETE (statements.py). */
inline store_complete(t, a, ok) {
  if
  :: st == COMPLETED && tok == t && !EXPIRED -> ok = 1   /* its own earlier delivery */
#ifdef BROKEN_COMPLETE
  :: st == IN_PROGRESS && !EXPIRED ->
#else
  :: OWNED(t) ->
#endif
     st = COMPLETED; answer = a; lease_end = clk; expires = clk + TTL; probation = 0;
     if
     :: first_answer == 0 -> first_answer = a
     :: else -> skip
     fi;
     ok = 1
  :: else -> ok = 0
  fi
}

/* Store.release: MemoryStore.release; release.lua; RELEASE (statements.py); SQLStore.release
   settles a record whose effect was committed instead (RELEASE_COMMITTED). */
inline store_release(t, ok) {
  if
  :: OWNED(t) && committed_at -> st = COMMITTED; lease_end = clk; probation = 0; ok = 1
  :: OWNED(t) && !committed_at ->
#ifndef FENCED
     if
     :: effects > 0 && exposed == PROTECTED -> exposed = W_RELEASED
     :: else -> skip
     fi;
#endif
     forget_record(); ok = 1
  :: else -> ok = 0
  fi
}

/* The clock moves on its own: between two steps of any actor, any number of ticks pass. */
active proctype Clock() {
end: do
  :: atomic {
       clk < MAXT -> clk++;
#ifdef FENCED
       /* ProofTable.purge_expired (proofs.py), at once: write_proof's upsert takes an
          expired proof as free, so purged now or later is the same; so is a retention */
       if
       :: retained_until <= clk -> retained_until = 0
       :: else -> skip
       fi;
       if
       :: pexp <= clk -> ptok = 0; pexp = 0
       :: else -> skip
       fi
#else
       skip
#endif
     }
  od
}

/* Store.purge_expired (PURGES, MemoryStore.purge_expired; Redis expires keys itself with the
   PEXPIRE of claim/renew/complete.lua). */
active proctype Purger() {
end: do
  :: atomic { EXPIRED -> record_goes(); forget_record() }
  od
}

/* A store that forgets everything at any moment: Redis restarted without persistence,
   FLUSHDB, a failover that lost the last writes. The app's database keeps its proofs. */
#ifndef SAME_DB
active proctype Forgetful() {
end: do
  :: atomic {
       FAULT && st != ABSENT ->
       faults++; forgets++;
#ifndef FENCED
       if
       :: effects > 0 && exposed == PROTECTED -> exposed = W_FORGOTTEN
       :: else -> skip
       fi;
#endif
       forget_record()
     }
  od
}
#endif

/* The effect's transaction commits: the effect and its proof together. */
inline commits(t, a) {
  a_one_fenced_effect = (effects == 0 || retained_until <= clk);
  assert(a_one_fenced_effect);
  effects++; retained_until = clk + TTL; committed = committed | (1 << t); a = t
}

/* The effect lands: the app's transaction commits (fenced), or a side effect happens. */
inline lands(t, gen, a) {
#ifdef SAME_DB
  /* fence(session) on the store's own database: FENCE marks this token's record committed
     (KEY_IS, MINE) and keeps it a TTL from now; when it changed nothing, REFENCE writes the
     record again if no record of the key is there; otherwise LeaseLost, and the transaction
     rolls back (statements.py) */
  if
  :: st == IN_PROGRESS && tok == t ->
     committed_at = 1; probation = 0;
#ifndef BROKEN_FENCE_TTL
     expires = clk + TTL;
#endif
     commits(t, a)
  :: st == ABSENT ->
     st = IN_PROGRESS; tok = t; lease_end = clk + LEASE; expires = clk + TTL;
     answer = 0; first_answer = 0; holder_alive = 1; holder_fate = RUNNING; committed_at = 1;
     commits(t, a)
  :: else -> a = TAKEN_OVER
  fi
#elif defined(FENCED)
  /* fence(session) -> proofs.write_proof, in the effect's transaction: the upsert takes the
     row if it is free, expired or this token's own (_MINE_OR_FREE); otherwise
     EffectCommitted, the transaction rolls back, and the answer is the refusal. */
  if
#ifdef BROKEN_PROOF
  :: true ->
#else
  :: ptok == 0 || ptok == t || pexp <= clk ->
#endif
     ptok = t; pexp = clk + TTL; commits(t, a)
  :: else -> a = REFUSED
  fi
#else
  /* the window that let it run twice: why the last effect lost its protection, or why
     this one never had it */
  if
  :: st == IN_PROGRESS && tok == t -> window = exposed
  :: else ->
     if
     :: gen != forgets -> window = W_FORGOTTEN
     :: else -> window = W_LATE
     fi
  fi;
  if
  :: effects > 0 ->
     d_documented_window = (window != PROTECTED);
     assert(d_documented_window);
     c_code {
       if (!(windows_seen & (1u << now.window))) {
         windows_seen |= 1u << now.window;
         printf("WINDOW %s\n", WINDOWS[now.window]);
       }
     }
  :: else -> skip
  fi;
  /* from here on, this effect is protected only if this worker still holds the key */
  if
  :: st == IN_PROGRESS && tok == t -> exposed = PROTECTED
  :: else -> exposed = window
  fi;
  window = 0;
  if
  :: effects < 2 -> effects++
  :: else -> skip               /* two are enough to label a double run */
  fi;
  a = t
#endif
}

/* The holder of the record ends: how, for the windows' labels. */
inline holder_ends(t, how) {
  if
  :: st != ABSENT && tok == t -> holder_fate = how
  :: else -> skip
  fi
}

/* A store call is sent in the tick the store runs it, or in the one before. */
inline sent_at(sent) {
  if
  :: sent = clk
  :: clk > 0 -> sent = clk - 1
  fi
}

proctype Caller(byte c) {
  byte n, t, proven, out, gen, a, rv, sent;
  byte phase;        /* 0: before the effect, 1: begun, 2: landed */
  bit ok, lost;
  do
  :: n < ATTEMPTS ->
     n++;
     t = c * ATTEMPTS + n;
#ifdef BROKEN_CLAIM
     atomic { claim_reads(t, out); gen = forgets; proven = clk + LEASE }
     if                            /* a read, then a separate write: the claim is not atomic */
     :: out == ACQUIRED -> atomic { claim_writes(t) }
     :: else -> skip
     fi;
#else
     atomic {
       sent_at(sent);              /* Call.claim: claimed_at = engine.clock() */
       proven = sent + LEASE;      /* LeaseKeeper.proven_until = claimed_at + lease */
       store_claim(t, out);
       gen = forgets;
       if
       :: skip
       :: true -> store_claim(t, rv);      /* the reply lost, the statement run again */
          f_same_outcome = (rv == out);
          assert(f_same_outcome)
       :: FAULT -> faults++; out = ERROR    /* the reply lost: StoreError, the caller's 503 */
       fi;
       rv = 0; sent = 0
     }
#endif
     if
     :: out == ACQUIRED ->
        out = 0;
        /* Hold.keep: first_renewal_in() == 0 (the claim took a third of the lease) ->
           LeaseKeeper.renew_to_start, or LeaseUnproven: nothing runs, the key lapses */
        if
        :: clk + LEASE >= proven + THIRD -> goto renewal
        :: else -> skip
        fi;
work:   do
        :: clk + LEASE >= proven + THIRD ->
           /* LeaseKeeper.keep: a renewal, due a third of the lease after the last proof */
           goto renewal
        :: (clk >= proven || lost) && !(phase == 2 && a == t && FENCED_RUN) ->
           /* Hold._lost: the proof ran out or the key was taken over: the work is stopped,
              unless its effect is fenced (CurrentClaim.fenced); the key is left to lapse */
           goto gone
        :: FAULT -> atomic { faults++; holder_ends(t, CRASHED) }; goto gone  /* it dies */
        :: atomic {
             phase == 0 && clk < proven && !lost ->
             /* the handler begins its effect while its lease is proven */
             e_lease_proven = (gen != forgets || (st == IN_PROGRESS && tok == t && lease_end > clk));
             assert(e_lease_proven);
             phase = 1
           }
        :: phase == 1 -> atomic { lands(t, gen, a); phase = 2 }
        :: phase == 2 -> break
        od;
        /* Exchange._record_or_release: an answer below 500 is recorded (Call.complete), a
           5xx after the effect releases the key (Call.release) */
        if
        :: FAULT ->
           atomic {
             faults++;
             store_release(t, ok);
             if
             :: skip
             :: true -> store_release(t, ok)      /* delivered twice: gone either way */
             fi
           }
        :: atomic {
             true ->                /* (an else inside must not read as this selection's) */
             store_complete(t, a, ok);
             if
             :: skip
             :: true -> store_complete(t, a, rv); /* the reply lost, the statement run again */
                f_same_outcome = (rv == ok);
                assert(f_same_outcome)
             fi;
             /* b: an acknowledged completion is the one the record keeps */
             b_first_answer = (!ok || (st == COMPLETED && answer == a && first_answer == a));
             assert(b_first_answer);
             rv = 0
           }
        :: FAULT ->                 /* StoreError: the completion never ran */
           atomic { faults++; holder_ends(t, UNRECORDED) }
        fi;
        goto gone;
renewal:
        atomic {
          sent_at(sent);            /* LeaseKeeper._renew_once: sent_at = clock() */
          store_renew(t, rv);
          if
          :: skip
          :: true -> store_renew(t, rv)     /* the reply lost, the statement run again */
          :: FAULT -> faults++; rv = UNKNOWN    /* StoreError: Call.renew answers None */
          fi;
          if
          :: rv == OWNED_NOW && sent + LEASE > proven -> proven = sent + LEASE
          :: rv == NOT_OWNED -> lost = 1
          :: else -> skip
          fi;
          rv = 0; sent = 0
        }
        if
        :: phase == 0 && clk >= proven -> goto gone   /* renew_to_start failed: LeaseUnproven */
        :: else -> goto work
        fi
     :: else -> out = 0             /* a replay, 409 in progress, a StoreError: answered */
     fi;
gone:
     atomic {
       if
       :: st != ABSENT && tok == t -> holder_alive = 0
       :: else -> skip
       fi;
       proven = 0; gen = 0; a = 0; phase = 0; ok = 0; lost = 0
     }
     /* the caller sends the request again (its answer was lost, or it had none), or stops */
     if
     :: skip
     :: break
     fi
  :: else -> break
  od
}

init {
  byte c;
  atomic {
    do
    :: c < CALLERS -> run Caller(c); c++
    :: else -> break
    od
  }
}
