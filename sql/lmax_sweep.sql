-- The bound and the oracle's draft lengths per Lmax, for every acceptance rule and with / without
-- the plain step (k = 0), over all sequences and per category (the `summary` table). Totals pool
-- sequences: S = total AR cost / total dp[0]. speedup_bound is in-sample (the bound);
-- speedup_crossfit chooses k* on one tail draw and prices it on another (the achievable
-- estimate), null unless every pooled sequence has it. Mean draft and accepted lengths are
-- visitation-weighted over every state of every sequence.
WITH per_category AS (
    SELECT lmax, acceptance, plain_step, category, ar_ms, dp0_ms, dp0_crossfit_ms,
           visit_sum, visit_k_sum, visit_accept_sum
    FROM summary
    UNION ALL
    SELECT lmax, acceptance, plain_step, 'all', ar_ms, dp0_ms, dp0_crossfit_ms,
           visit_sum, visit_k_sum, visit_accept_sum
    FROM summary
)
SELECT
    lmax,
    acceptance,
    plain_step,
    category,
    count(*)                                   AS sequences,
    sum(ar_ms) / sum(dp0_ms)                   AS speedup_bound,
    CASE WHEN count(dp0_crossfit_ms) = count(*)
         THEN sum(ar_ms) / sum(dp0_crossfit_ms) END AS speedup_crossfit,
    sum(visit_k_sum) / sum(visit_sum)          AS mean_draft_len,
    sum(visit_accept_sum) / sum(visit_sum)     AS mean_accepted
FROM per_category
GROUP BY lmax, acceptance, plain_step, category
ORDER BY category = 'all' DESC, category, acceptance, plain_step DESC, lmax;
