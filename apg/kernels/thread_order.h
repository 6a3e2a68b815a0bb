/* Per-thread partial sums added in thread order: the same bits on every run.
 *
 * Backward kernels accumulate the gradients of shared inputs (the weights) per thread and
 * add them into the output once per thread. Added under a critical section they went in
 * whatever order the threads finished, which changes from run to run, and floating-point
 * addition is not associative (under -ffast-math the compiler may also fold the output
 * into a thread's own sum): at 2 threads, repeated calls on the same inputs gave weight
 * gradients differing in their last bits, and two trainings from one seed drifted apart.
 *
 * Instead each thread adds its sums into its own zeroed row of a shared buffer, with the
 * very statements that used to add them into the output, and after the parallel region the
 * calling thread adds the rows into the output in thread order. The result depends on the
 * thread count (how the work was split), never on timing; at one thread it is the old
 * arithmetic bit for bit (0 + row is row). The region's main loop is left as it was: an
 * ordered loop in its place made GCC compile that loop differently, changing the last
 * bits of other outputs even at one thread.
 *
 *     T *parts = THREAD_PARTS(T, n);              // one zeroed row of n per thread, or NULL
 *     T fallback[parts ? 1 : n];                  // no memory: one thread, its row here
 *     if (!parts) memset(fallback, 0, sizeof(fallback));
 *     int team = 1;
 *     #pragma omp parallel if (parts != NULL)
 *     { ...; T *mine = MY_ROW(parts, fallback, n); ... mine[k] += ...; TEAM_SIZE(team); }
 *     for (int t = 0; t < team; ++t) { const T *row = ROW(parts, fallback, n, t); out[k] += row[k]; }
 *     free(parts);
 */
#ifndef APG_THREAD_ORDER_H
#define APG_THREAD_ORDER_H

#include <omp.h>
#include <stdlib.h>

/* Zeroed rows of n values for each thread the next parallel region can have (at most
 * omp_get_max_threads(), read in the thread that opens it), or NULL. */
#define THREAD_PARTS(T, n) ((T *)calloc((size_t)omp_get_max_threads() * (size_t)(n), sizeof(T)))

/* Thread t's row, and the calling thread's own inside the region. */
#define ROW(parts, fallback, n, t) ((parts) ? (parts) + (long)(t) * (n) : (fallback))
#define MY_ROW(parts, fallback, n) ROW(parts, fallback, n, omp_get_thread_num())

/* Records the team's size: thread 0 writes it, the region's closing barrier publishes it. */
#define TEAM_SIZE(team)                                                                   \
    do {                                                                                  \
        if (omp_get_thread_num() == 0) (team) = omp_get_num_threads();                    \
    } while (0)

#endif
