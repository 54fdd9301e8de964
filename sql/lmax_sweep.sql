-- The bound and the oracle's draft lengths per Lmax, over all sequences and per category
-- (the `summary` table). Totals pool sequences: S = total AR cost / total dp[0]; mean draft
-- and accepted lengths are visitation-weighted over every state of every sequence.
SELECT
    lmax,
    'all'                                  AS category,
    count(*)                               AS sequences,
    sum(ar_ms) / sum(dp0_ms)               AS speedup_bound,
    sum(visit_k_sum) / sum(visit_sum)      AS mean_draft_len,
    sum(visit_accept_sum) / sum(visit_sum) AS mean_accepted
FROM summary
GROUP BY lmax
UNION ALL
SELECT
    lmax,
    category,
    count(*),
    sum(ar_ms) / sum(dp0_ms),
    sum(visit_k_sum) / sum(visit_sum),
    sum(visit_accept_sum) / sum(visit_sum)
FROM summary
GROUP BY lmax, category
ORDER BY category = 'all' DESC, category, lmax;
