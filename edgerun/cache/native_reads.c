/* Expert-block reads without the GIL (edgerun/cache/native.py, ``reader: native``).
 *
 * A pool of POSIX threads reads fixed-size blocks with pread, checks each against its xxh3-64
 * (the function xxhash's Python module exports: the bytes the manifest was written with), and
 * hands it on: into caller memory directly, by memcpy into host memory, or by an asynchronous
 * CUDA copy (driver API, function pointers the caller passes) on the caller's stream into device
 * memory, fenced by one event per staging buffer that the buffer's next read waits for. Python
 * only submits a job and later waits for its ticket (ctypes releases the GIL for both calls), so
 * no read, check or copy waits for the interpreter.
 *
 * Jobs run in ticket order, except that a staged job (a prefetch) waits while a job of any other
 * kind is queued (next_piece). A block may be read as several pieces at once (``pieces`` at open):
 * the threads take a job's pieces in turn, so one block keeps several requests in the disk's
 * queue (a virtio or network disk serves one large request at about half the rate it serves
 * four); the thread that ends the last piece checks the whole block and hands it on. A job
 * reading into a staging buffer takes one from the free list (its first piece waits for one,
 * then for its fence; the other pieces wait for that); a staged job (prefetch) keeps its buffer
 * after the read until the caller places it (er_place) or releases it. A job whose read fails its check, or
 * fails, keeps its buffer too: the caller reads it again its own way and then places or releases.
 * A ticket's record is freed when the caller finishes with it (er_wait with free, er_place,
 * er_release) or, for a dropped job, when the read ends.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef uint64_t (*hash_fn)(const void *, size_t);
typedef int (*cu_memcpy_fn)(unsigned long long, const void *, size_t, void *);
typedef int (*cu_ev_create_fn)(void **, unsigned);
typedef int (*cu_ev_fn)(void *);
typedef int (*cu_ev_record_fn)(void *, void *);
typedef int (*cu_ctx_get_fn)(void **);
typedef int (*cu_ctx_set_fn)(void *);

/* the CUDA driver API entry points the caller found (all NULL: no CUDA copies) */
typedef struct {
    cu_memcpy_fn memcpy_htod; /* cuMemcpyHtoDAsync_v2 */
    cu_ev_create_fn ev_create; /* cuEventCreate */
    cu_ev_record_fn ev_record; /* cuEventRecord */
    cu_ev_fn ev_sync;          /* cuEventSynchronize */
    cu_ev_fn ev_destroy;       /* cuEventDestroy_v2 */
    cu_ctx_get_fn ctx_get;     /* cuCtxGetCurrent */
    cu_ctx_set_fn ctx_set;     /* cuCtxSetCurrent */
} cuda_api;

enum { FREE = 0, QUEUED, RUNNING, DONE, CANCELLED };
enum { TO_STAGE = 0, TO_HOST = 1, TO_DEVICE = 2, TO_DIRECT = 3 };
enum { OK = 0, BAD_SUM = 1, IO_ERROR = 2, SHORT = 3, CUDA_ERROR = 4, NO_JOB = 5 };

#define JOBS 4096 /* tickets in flight at most (the caller keeps far fewer: staging bounds them) */

typedef struct {
    int64_t ticket;
    int state, kind, fd, check, count, dropped, buf, result, err;
    int taken, left, ready; /* pieces handed to threads, pieces not yet ended, buffer ready to read into */
    uint64_t offset, expect, dst, stream;
    int64_t got;
    double seconds, started;
} job_t;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t work, done, bufs;
    pthread_t *threads;
    int nthreads, stop;
    int reading, max_reading; /* threads taking or reading a piece, and how many may (the rest check
                               * and hand on finished blocks while these read) */
    uint64_t block, piece; /* a block's bytes; a piece's (a multiple of 4096, the last may be less) */
    int npieces;
    int nbuf, nfree;
    char **buffers;
    int *free_list;
    void **events;  /* one per staging buffer (CUDA), its last copy's fence */
    int *fenced;
    hash_fn hash;
    cuda_api cu;
    void *ctx;
    job_t jobs[JOBS];
    int64_t next, head; /* next ticket to hand out; lowest ticket not yet taken by a thread */
    int64_t buf_tickets, buf_serving; /* the staging buffers' queue: turns handed out, turn served */
    /* counters (ReadStats) */
    int64_t reads, bytes, faults_dropped, inflight, peak; /* peak: the most requests ever in flight */
    double seconds, wall, busy_since;
    double depth_area, depth_since; /* the integral of requests in flight over time, since its last change */
} pool_t;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static job_t *job_of(pool_t *p, int64_t ticket) {
    job_t *j = &p->jobs[ticket % JOBS];
    return (ticket >= 0 && j->ticket == ticket && j->state != FREE) ? j : NULL;
}

/* with p->mu held */
static void give_buffer(pool_t *p, int b) {
    if (b < 0) return;
    p->free_list[p->nfree++] = b;
    pthread_cond_broadcast(&p->bufs);
}

static void free_job(pool_t *p, job_t *j) {
    give_buffer(p, j->buf);
    j->buf = -1;
    j->state = FREE;
}

/* Copy ``n`` bytes of staging buffer ``b`` to where ``kind`` says; with p->mu NOT held. */
static int hand_on(pool_t *p, int b, int kind, uint64_t dst, uint64_t stream, int *err) {
    if (kind == TO_HOST) {
        memcpy((void *)(uintptr_t)dst, p->buffers[b], p->block);
        return OK;
    }
    if (kind == TO_DEVICE) {
        int rc = p->cu.memcpy_htod(dst, p->buffers[b], p->block, (void *)(uintptr_t)stream);
        if (!rc) rc = p->cu.ev_record(p->events[b], (void *)(uintptr_t)stream);
        if (rc) {
            *err = rc;
            return CUDA_ERROR;
        }
        p->fenced[b] = 1; /* the buffer's next read waits for this copy */
    }
    return OK;
}

static int64_t read_all(int fd, char *to, uint64_t n, uint64_t offset, int *err) {
    uint64_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, to + got, n - got, (off_t)(offset + got));
        if (r < 0) {
            if (errno == EINTR) continue;
            *err = errno;
            return -1;
        }
        if (r == 0 || (r % 4096)) { got += (uint64_t)r; break; } /* end of file, or an O_DIRECT tail */
        got += (uint64_t)r;
    }
    return (int64_t)got;
}

static int due(pool_t *p, job_t *j, int64_t ticket) { /* a piece of it is left to take */
    return j->ticket == ticket && j->taken < p->npieces && (j->state == QUEUED || j->state == RUNNING);
}

/* with p->mu held: the job whose next piece a thread may take (NULL: none due): in ticket order,
 * a block already started or a read a lookup waits for; a staged read (a prefetch: a guess) not
 * yet started only when neither is due, so a guess issued early never delays a read the step
 * needs now. */
static job_t *next_piece(pool_t *p) {
    while (p->head < p->next && !due(p, &p->jobs[p->head % JOBS], p->head))
        p->head++; /* skip tickets taken, cancelled or (record reused) not yet due */
    job_t *staged = NULL;
    for (int64_t t = p->head; t < p->next; t++) {
        job_t *j = &p->jobs[t % JOBS];
        if (!due(p, j, t)) continue;
        if (j->state == RUNNING || j->kind != TO_STAGE) return j;
        if (!staged) staged = j;
    }
    return staged;
}

/* The end of a job whose pieces have all ended (j->got: the bytes they read; j->err: the first
 * piece's errno that failed, 0 if none); with p->mu NOT held on entry and held on return. */
static void finish(pool_t *p, job_t *j, int b) {
    int kind = j->kind, err = j->err;
    int64_t got = j->got;
    uint64_t n = p->block, expect = j->expect, dst = j->dst, stream = j->stream;
    int check = j->check;
    char *to = kind == TO_DIRECT ? (char *)(uintptr_t)j->dst : p->buffers[b];
    double dt = now() - j->started;
    int result = err ? IO_ERROR : (uint64_t)got != n ? SHORT : OK;
    if (result == OK && check && p->hash(to, n) != expect) result = BAD_SUM;
    if (result == OK && kind != TO_STAGE && kind != TO_DIRECT) result = hand_on(p, b, kind, dst, stream, &err);

    pthread_mutex_lock(&p->mu);
    if (result == OK) {
        if (j->count) { /* else the caller counts it, once its own check has passed */
            p->reads++;
            p->bytes += got;
            p->seconds += dt;
        }
        if (kind == TO_HOST || kind == TO_DEVICE) { /* handed on: the buffer goes back */
            give_buffer(p, b);
            j->buf = -1;
        }
    }
    j->result = result;
    j->err = err;
    j->seconds = dt;
    j->state = DONE;
    if (j->dropped) { /* nobody will claim it */
        if (result != OK) p->faults_dropped++;
        free_job(p, j);
    }
    pthread_cond_broadcast(&p->done);
}

static void *worker(void *arg) {
    pool_t *p = arg;
    if (p->ctx && p->cu.ctx_set) p->cu.ctx_set(p->ctx);
    pthread_mutex_lock(&p->mu);
    for (;;) {
        job_t *j = p->reading < p->max_reading ? next_piece(p) : NULL;
        if (p->stop) break;
        if (!j) {
            pthread_cond_wait(&p->work, &p->mu);
            continue;
        }
        p->reading++;
        int k = j->taken++;
        if (k == 0) {
            j->state = RUNNING;
            j->left = p->npieces;
            j->started = now();
        }
        if (j->taken < p->npieces) pthread_cond_signal(&p->work); /* another thread takes the next piece */
        if (j->kind != TO_DIRECT && k == 0) {
            /* buffers go to jobs in the order threads take them (a condition variable wakes any
             * waiter; next_piece's order): a job taken later holding the last buffer while an
             * earlier one waits could leave the caller waiting for ever. Staged jobs keep theirs
             * until claimed, but the caller keeps at most staging - top_k of them outstanding */
            int64_t turn = p->buf_tickets++;
            while ((turn != p->buf_serving || !p->nfree) && !p->stop) pthread_cond_wait(&p->bufs, &p->mu);
            if (p->stop) break;
            p->buf_serving++;
            int b = p->free_list[--p->nfree];
            j->buf = b;
            if (p->fenced[b]) { /* its last copy out must be done before it is read into */
                pthread_mutex_unlock(&p->mu);
                p->cu.ev_sync(p->events[b]);
                pthread_mutex_lock(&p->mu);
                p->fenced[b] = 0;
            }
            j->ready = 1;
            pthread_cond_broadcast(&p->bufs); /* the next in line may go if a buffer is left; this job's pieces */
        } else if (j->kind == TO_DIRECT) {
            j->ready = 1;
        }
        while (!j->ready && !p->stop) pthread_cond_wait(&p->bufs, &p->mu);
        if (p->stop) break;
        int b = j->buf;
        char *to = j->kind == TO_DIRECT ? (char *)(uintptr_t)j->dst : p->buffers[b];
        uint64_t at = (uint64_t)k * p->piece;
        uint64_t n = p->block - at < p->piece ? p->block - at : p->piece;
        int fd = j->fd, err = 0;
        uint64_t offset = j->offset + at;
        double t = now();
        p->depth_area += (double)p->inflight * (t - p->depth_since);
        p->depth_since = t;
        if (p->inflight++ == 0) p->busy_since = t;
        if (p->inflight > p->peak) p->peak = p->inflight;
        pthread_mutex_unlock(&p->mu);

        int64_t got = read_all(fd, to + at, n, offset, &err);

        pthread_mutex_lock(&p->mu);
        t = now();
        p->depth_area += (double)p->inflight * (t - p->depth_since);
        p->depth_since = t;
        if (--p->inflight == 0) p->wall += t - p->busy_since;
        p->reading--; /* another thread may read while this one checks and hands the block on */
        pthread_cond_signal(&p->work);
        if (got < 0) {
            if (!j->err) j->err = err ? err : EIO;
        } else {
            j->got += got;
        }
        if (--j->left == 0) { /* the last piece to end finishes the job */
            pthread_mutex_unlock(&p->mu);
            finish(p, j, b);
        }
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* ---- the caller's side (Python, through ctypes) ------------------------------------------ */

void er_close(pool_t *p);

/* ``pieces``: the parts a block is read in at once (each a multiple of 4096 bytes; 1: whole
 * blocks); ``nthreads`` should be reads in flight x pieces: at most that many requests are at the
 * disk. ``spare`` more threads let a finished block's check and copy run while the next read
 * starts (0: the thread that read a block's last piece checks it before it reads again). */
pool_t *er_open(int nthreads, int spare, uint64_t block, int pieces, int nbuf, const uint64_t *buffers,
                hash_fn hash, const cuda_api *cu) {
    pool_t *p = calloc(1, sizeof(pool_t));
    if (!p) return NULL;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work, NULL);
    pthread_cond_init(&p->done, NULL);
    pthread_cond_init(&p->bufs, NULL);
    p->block = block;
    if (pieces < 1) pieces = 1;
    uint64_t pages = (block + 4095) / 4096;
    p->piece = (pages + (uint64_t)pieces - 1) / (uint64_t)pieces * 4096;
    if (p->piece > block) p->piece = block;
    p->npieces = (int)((block + p->piece - 1) / p->piece);
    p->hash = hash;
    p->nbuf = nbuf;
    p->buffers = calloc(nbuf, sizeof(char *));
    p->free_list = calloc(nbuf, sizeof(int));
    p->events = calloc(nbuf, sizeof(void *));
    p->fenced = calloc(nbuf, sizeof(int));
    p->max_reading = nthreads;
    if (spare > 0) nthreads += spare;
    p->threads = calloc(nthreads, sizeof(pthread_t));
    if (!p->buffers || !p->free_list || !p->events || !p->fenced || !p->threads) {
        er_close(p);
        return NULL;
    }
    if (cu) { /* the caller's current context: the worker threads copy in it */
        p->cu = *cu;
        if (p->cu.ctx_get(&p->ctx) || !p->ctx) {
            er_close(p);
            return NULL;
        }
    }
    for (int i = 0; i < nbuf; i++) {
        p->buffers[i] = (char *)(uintptr_t)buffers[i];
        p->free_list[p->nfree++] = i;
        if (cu && p->cu.ev_create(&p->events[i], 2 /* CU_EVENT_DISABLE_TIMING */)) {
            er_close(p);
            return NULL;
        }
    }
    for (int i = 0; i < JOBS; i++) p->jobs[i].ticket = -1;
    for (int i = 0; i < nthreads; i++) {
        if (pthread_create(&p->threads[i], NULL, worker, p)) break;
        p->nthreads++;
    }
    if (p->nthreads != nthreads) {
        er_close(p);
        return NULL;
    }
    return p;
}

/* Queue a read of ``block`` bytes at ``offset`` of ``fd`` (``check``: against ``expect``;
 * ``count``: counted as read when it ends well, else the caller counts it, er_count); returns its
 * ticket, or -1 when the ticket's record is still in use (more than JOBS tickets outstanding). */
int64_t er_submit(pool_t *p, int fd, uint64_t offset, int kind, uint64_t dst, uint64_t stream, int check,
                  uint64_t expect, int count) {
    pthread_mutex_lock(&p->mu);
    job_t *j = &p->jobs[p->next % JOBS];
    if (j->state != FREE) {
        pthread_mutex_unlock(&p->mu);
        return -1;
    }
    memset(j, 0, sizeof(*j));
    j->ticket = p->next++;
    j->state = QUEUED;
    j->kind = kind;
    j->fd = fd;
    j->offset = offset;
    j->dst = dst;
    j->stream = stream;
    j->check = check;
    j->expect = expect;
    j->count = count;
    j->buf = -1;
    pthread_cond_signal(&p->work);
    pthread_mutex_unlock(&p->mu);
    return j->ticket;
}

/* Block until ``ticket``'s read has ended: out = {result, errno, bytes, buffer (-1: none)},
 * seconds. With ``release``, a job that holds no buffer is freed here (else: er_place / er_release). */
int er_wait(pool_t *p, int64_t ticket, int64_t *out, double *seconds, int release) {
    pthread_mutex_lock(&p->mu);
    job_t *j = job_of(p, ticket);
    while (j && j->state != DONE) {
        pthread_cond_wait(&p->done, &p->mu);
        j = job_of(p, ticket);
    }
    if (!j) {
        pthread_mutex_unlock(&p->mu);
        return NO_JOB;
    }
    out[0] = j->result;
    out[1] = j->err;
    out[2] = j->got;
    out[3] = j->buf;
    *seconds = j->seconds;
    if (release && j->buf < 0) free_job(p, j);
    pthread_mutex_unlock(&p->mu);
    return OK;
}

/* Whether ``ticket``'s read has ended (1), is queued or running (0), or is not outstanding (-1). */
int er_done(pool_t *p, int64_t ticket) {
    pthread_mutex_lock(&p->mu);
    job_t *j = job_of(p, ticket);
    int done = j ? j->state == DONE : -1;
    pthread_mutex_unlock(&p->mu);
    return done;
}

/* Hand a finished job's buffer on (``kind`` TO_HOST / TO_DEVICE, as a read would have; TO_STAGE:
 * nowhere), give the buffer back and free the ticket. A job with no buffer is only freed. */
int er_place(pool_t *p, int64_t ticket, int kind, uint64_t dst, uint64_t stream, int *err) {
    pthread_mutex_lock(&p->mu);
    job_t *j = job_of(p, ticket);
    if (!j || j->state != DONE) {
        pthread_mutex_unlock(&p->mu);
        return NO_JOB;
    }
    int b = j->buf, rc = OK;
    pthread_mutex_unlock(&p->mu);
    *err = 0;
    if (b >= 0) rc = hand_on(p, b, kind, dst, stream, err);
    pthread_mutex_lock(&p->mu);
    free_job(p, j);
    pthread_mutex_unlock(&p->mu);
    return rc;
}

/* Count a read the caller made itself into a job's buffer (its own re-read) as done. */
void er_count(pool_t *p, int64_t bytes, double seconds) {
    pthread_mutex_lock(&p->mu);
    p->reads++;
    p->bytes += bytes;
    p->seconds += seconds;
    pthread_mutex_unlock(&p->mu);
}

/* A job nobody will claim: cancelled if queued (returns 1); else freed now if it has ended, or
 * when it ends (returns 0; a failed one is counted in faults_dropped). */
int er_drop(pool_t *p, int64_t ticket) {
    pthread_mutex_lock(&p->mu);
    job_t *j = job_of(p, ticket);
    int cancelled = 0;
    if (j) {
        if (j->state == QUEUED) {
            free_job(p, j);
            cancelled = 1;
        } else if (j->state == DONE) {
            if (j->result != OK) p->faults_dropped++;
            free_job(p, j);
        } else {
            j->dropped = 1;
        }
    }
    pthread_mutex_unlock(&p->mu);
    return cancelled;
}

/* out = {reads, bytes, faults of dropped jobs, requests in flight, the most ever in flight},
 * secs = {summed read seconds, wall, requests in flight integrated over time (their mean while
 * busy: this over wall)}. */
void er_stats(pool_t *p, int64_t *out, double *secs) {
    pthread_mutex_lock(&p->mu);
    out[0] = p->reads;
    out[1] = p->bytes;
    out[2] = p->faults_dropped;
    out[3] = p->inflight;
    out[4] = p->peak;
    secs[0] = p->seconds;
    double t = now();
    secs[1] = p->wall + (p->inflight ? t - p->busy_since : 0.0);
    secs[2] = p->depth_area + (double)p->inflight * (t - p->depth_since);
    pthread_mutex_unlock(&p->mu);
}

/* Stop the threads once the reads they run end (queued ones are dropped), wait for every
 * buffer's last copy out, destroy the events, free the pool. */
void er_close(pool_t *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->work);
    pthread_cond_broadcast(&p->bufs);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->nthreads; i++) pthread_join(p->threads[i], NULL);
    if (p->events) {
        for (int i = 0; i < p->nbuf; i++) {
            if (!p->events[i]) continue;
            if (p->fenced && p->fenced[i]) p->cu.ev_sync(p->events[i]);
            p->cu.ev_destroy(p->events[i]);
        }
    }
    free(p->buffers);
    free(p->free_list);
    free(p->events);
    free(p->fenced);
    free(p->threads);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->work);
    pthread_cond_destroy(&p->done);
    pthread_cond_destroy(&p->bufs);
    free(p);
}
