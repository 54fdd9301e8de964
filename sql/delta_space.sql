-- Delta space (the paper's section 5.2) over the `decisions` table: for every state, every
-- rejected budget k != k* (k = 0, the plain step, included when it was available) against the
-- optimal k*, the change in expected progress and in expected round cost, in time (ms) and in
-- experts (U). One decisions table holds one configuration; the join keys keep them apart.
WITH best AS (
    SELECT seq_id, lmax, acceptance, plain_step, i, k AS k_star, e_accept, e_cost_ms,
           e_experts, visit
    FROM decisions
    WHERE chosen
)
SELECT
    d.seq_id,
    d.lmax,
    d.acceptance,
    d.plain_step,
    d.i,
    d.k,
    b.k_star,
    b.visit,
    d.e_accept - b.e_accept     AS d_accept,
    d.e_cost_ms - b.e_cost_ms   AS d_cost_ms,
    d.e_experts - b.e_experts   AS d_experts,
    -- I: more progress for more cost (rejected as too risky); III: less progress for less
    -- cost (rejected as too cautious); II and IV would be dominated choices. With exact-greedy
    -- acceptance a longer chain past the first mismatch adds no progress: 'flat'.
    CASE
        WHEN abs(d.e_accept - b.e_accept) < 1e-12 THEN 'flat'
        WHEN d.e_accept - b.e_accept > 0 AND d.e_cost_ms - b.e_cost_ms >= 0 THEN 'I'
        WHEN d.e_accept - b.e_accept > 0 THEN 'II'
        WHEN d.e_cost_ms - b.e_cost_ms < 0 THEN 'III'
        ELSE 'IV'
    END                         AS quadrant
FROM decisions AS d
JOIN best AS b USING (seq_id, lmax, acceptance, plain_step, i)
WHERE NOT d.chosen;
