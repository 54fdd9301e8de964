-- Per-budget summary of timed verification rounds (the `rounds` table).
-- K = 0 rows are plain autoregressive steps (m = 1); a row with draft_forwards = K + 1 summarises
-- look rounds (K tokens, then one more draft distribution looked at before stopping).
SELECT
    k,
    m,
    draft_forwards,
    draft_forwards > k                         AS look,
    count(*)                                   AS rounds,
    count(DISTINCT gen_id)                     AS generations,
    avg(t_target_ms)                           AS mean_t_target_ms,
    median(t_target_ms)                        AS median_t_target_ms,
    quantile_cont(t_target_ms, 0.95)           AS p95_t_target_ms,
    avg(t_draft_ms)                            AS mean_t_draft_ms,
    avg(u_bar)                                 AS mean_u_bar,
    min(u_bar)                                 AS min_u_bar,
    max(u_bar)                                 AS max_u_bar,
    avg(ctx_len)                               AS mean_ctx_len,
    avg(accepted)                              AS mean_accepted,
    avg(accepted + 1) / avg(t_target_ms + t_draft_ms) AS tokens_per_ms
FROM rounds
GROUP BY k, m, draft_forwards
ORDER BY k, draft_forwards;
