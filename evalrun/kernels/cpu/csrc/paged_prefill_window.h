/* paged_prefill.c's attention variants: the softmax of a task's rows under a sliding window and
 * soft-capping of its scores (included after softmax_rows, with its vector macros). */
/* Under a sliding window: row r (lane) sees keys lo[r] <= p < lim[r] only, the window's start
 * below and its position above; keys [kb, nk) are the task's. Each lane as softmax_rows computes
 * it (its max over its keys, then exp(s - max) summed in key order), its unseen keys weighing 0
 * (adding 0 leaves a sum's bits as they are, so where kb falls does not change a row). */
static void softmax_rows_window(float *sc, int64_t rp, int nvec, int kb, int nk, const float *lo, const float *lim,
                                float *inv) {
#if VW == 16
    for (int i = 0; i < nvec; i++) {
        float *col = sc + i * VW;
        const vec l0 = VLOAD(lo + i * VW), l1 = VLOAD(lim + i * VW);
        vec mv = VSET1(-INFINITY), sum = VZERO();
        for (int p = kb; p < nk; p++) {
            const vec pv = VSET1((float)p);
            const __mmask16 sees = _mm512_cmp_ps_mask(pv, l0, _CMP_GE_OQ) & _mm512_cmp_ps_mask(pv, l1, _CMP_LT_OQ);
            mv = _mm512_mask_max_ps(mv, sees, mv, VLOAD(col + p * rp));
        }
        for (int p = kb; p < nk; p++) {
            const vec pv = VSET1((float)p);
            const __mmask16 sees = _mm512_cmp_ps_mask(pv, l0, _CMP_GE_OQ) & _mm512_cmp_ps_mask(pv, l1, _CMP_LT_OQ);
            const vec w = _mm512_maskz_mov_ps(sees, VEXP(VSUB(VLOAD(col + p * rp), mv)));
            VSTORE(col + p * rp, w);
            sum = VADD(sum, w);
        }
        VSTORE(inv + i * VW, _mm512_div_ps(VSET1(1.0f), sum));
    }
#else                                  /* lane by lane */
    for (int r = 0; r < nvec * VW; r++) {
        const int a = (int)lo[r], b = (int)lim[r];
        float m = -INFINITY, sum = 0.0f;
        for (int p = a; p < b; p++) m = sc[p * rp + r] > m ? sc[p * rp + r] : m;
        for (int p = kb; p < nk; p++) {
            const float w = p >= a && p < b ? expf(sc[p * rp + r] - m) : 0.0f;
            sc[p * rp + r] = w;
            sum = sum + w;
        }
        inv[r] = 1.0f / sum;
    }
#endif
}

/* Soft-capping of the task's scores in place: s = c * tanh(s / c), over keys [kb, nk) and every lane. */
static void cap_rows(float *sc, int64_t rp, int nvec, int kb, int nk, float cap) {
    for (int p = kb; p < nk; p++)
        for (int r = 0; r < nvec * VW; r++) sc[p * rp + r] = tanhf(sc[p * rp + r] / cap) * cap;
}

